"""``prune_diagnose``: can this model be pruned, and how far, without touching it. Every check
runs on a copy (the fixed ratio) or by masks (the search, ``apply=False``)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch

from openamct.pruning.batches import as_batches, main_tensor, run
from openamct.pruning.config import METHODS, parse_config
from openamct.pruning.domains import get_domain
from openamct.pruning.domains._common import evaluating
from openamct.pruning.report import PruneReport

logger = logging.getLogger(__name__)


@dataclass
class DiagnosisReport:
    targets: dict[str, int]  # prunable units per domain
    prune_works: bool
    prune_reduction: float
    prune_forward_ok: bool | None
    search_works: bool
    search_chosen_ratio: float | None
    notes: list[str] = field(default_factory=list)

    @property
    def any_domain_detected(self) -> bool:
        return any(v > 0 for v in self.targets.values())

    def summary(self) -> str:
        lines = [f"[prune-diagnose] prunable targets: {', '.join(f'{k}={v}' for k, v in self.targets.items())}",
                 f"  fixed-ratio prune: {'available' if self.prune_works else 'ineffective (0 cut)'} "
                 f"(cut {self.prune_reduction:.1%}"
                 + ("" if self.prune_forward_ok is None else f", forward {'OK' if self.prune_forward_ok else 'failed'}")
                 + ")",
                 f"  tolerance search: {'available' if self.search_works else 'unavailable'}"
                 + ("" if self.search_chosen_ratio is None else f" (chosen prune_ratio={self.search_chosen_ratio})")]
        return "\n".join(lines + [f"  - {n}" for n in self.notes])


def prune_diagnose(model, data=None, config=None, prune_ratio: float = 0.5, tolerance: float = 0.05) -> DiagnosisReport:
    """Count the prunable units of each domain, prune a copy at ``prune_ratio`` and run it, and run
    the tolerance search without applying it. ``model`` is left as it was."""
    from openamct.pruning.api import check_model, prune_fixed
    from openamct.pruning.search import tolerance_search

    check_model(model)
    cfg = parse_config(config)
    batches = as_batches(data)
    notes, targets = [], {}
    for name in METHODS:
        try:
            dom = get_domain(name)
        except ModuleNotFoundError:
            notes.append(f"the {name} domain is not available in this build")
            continue
        if name == "cnn" and not batches:
            continue  # the channel graph is traced on an input
        try:
            targets[name] = len(dom.units(model, batches[0] if batches else None))
        except Exception as e:  # noqa: BLE001 - the diagnosis reports failures, it does not raise them
            notes.append(f"{name}: finding units failed: {type(e).__name__}: {e}")
    if not any(targets.values()):
        notes.append("no prunable structure found in any domain")
    if not batches:
        notes.append("no data: the prune and search checks need calibration data")
        return DiagnosisReport(targets, False, 0.0, None, False, None, notes)
    works, reduction, forward_ok = False, 0.0, None
    try:
        trial = copy.deepcopy(model)
        rep = prune_fixed(trial, cfg.with_ratio(prune_ratio), batches, PruneReport())
        reduction = 1 - rep.params_after / rep.params_before if rep.params_before else 0.0
        works = rep.params_after < rep.params_before
        with evaluating(trial):
            forward_ok = bool(torch.isfinite(main_tensor(run(trial, batches[0]))).all())
        del trial
    except Exception as e:  # noqa: BLE001 - the diagnosis reports failures, it does not raise them
        notes.append(f"fixed-ratio prune failed: {type(e).__name__}: {e}")
    chosen = None
    try:
        res = tolerance_search(model, cfg, batches, tolerance, apply=False)
        chosen = res.chosen_ratio
        if chosen is None:
            notes.append("the tolerance search found no acceptable ratio: relax the tolerance")
    except Exception as e:  # noqa: BLE001
        notes.append(f"tolerance search failed: {type(e).__name__}: {e}")
    logger.info("prune_diagnose: targets %s, fixed cut %.1f%%", targets, 100 * reduction)
    return DiagnosisReport(targets, works, reduction, forward_ok, chosen is not None, chosen, notes)
