"""The steps every mode shares: find the units of each domain in play, score them once, turn a
ratio into keep masks, try masks without copying, and apply a choice in place with its report."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch import nn

from openamct.pruning.config import PruneConfig, is_skipped
from openamct.pruning.domains import Unit, get_domain
from openamct.pruning.report import PruneReport

logger = logging.getLogger(__name__)


@dataclass
class Target:
    """One domain in play: its method, its units (skip_layers removed) and their scores."""

    domain: object
    spec: object
    units: list[Unit]
    scores: dict[str, torch.Tensor]

    @property
    def maskable(self) -> bool:
        return not self.spec.rewrites_weights


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def backend(model: nn.Module) -> str:
    return "huggingface" if hasattr(model, "config") and hasattr(model, "save_pretrained") else "torch"


def prepare(model: nn.Module, cfg: PruneConfig, data: list, report: PruneReport,
            specs=None) -> list[Target]:
    """The targets of ``cfg`` (or of ``specs``, one MethodSpec per domain), scored on ``data``."""
    targets = []
    for spec in (specs if specs is not None else cfg.in_play()):
        try:
            domain = get_domain(spec.domain)
        except ModuleNotFoundError as e:
            if e.name != f"openamct.pruning.domains.{spec.domain}":
                raise
            msg = f"the {spec.domain} domain is not available in this build; it is not pruned"
            logger.warning(msg)
            report.add_warning(msg)
            continue
        domain.options = dict(spec.kwargs)
        units = domain.units(model, data[0])
        skipped = [u.name for u in units if is_skipped(u, cfg.skip_layers)]
        units = [u for u in units if u.name not in skipped]
        if skipped:
            report.add("find", spec.name, spec.domain, f"skip_layers leaves {len(skipped)} unit(s) whole")
        if not units:
            msg = f"{spec.domain}: no prunable structure found in the model"
            logger.info(msg)
            report.add_warning(msg)
            continue
        scores = domain.scores(model, units, data, spec.name)
        targets.append(Target(domain, spec, units, scores))
        report.add("score", spec.name, spec.domain, f"{len(units)} unit(s) scored on {len(data)} batch(es)")
    return targets


def keep_masks(target: Target, ratio: float | dict[str, float]) -> dict[str, torch.Tensor]:
    """Per unit, the channels kept at ``ratio`` (one for all units, or one per unit name): the
    highest scores, at least ``extra['min_keep']`` (1 unless the domain says more)."""
    out = {}
    for u in target.units:
        r = ratio[u.name] if isinstance(ratio, dict) else ratio
        n_keep = max(int(u.extra.get("min_keep", 1)), u.size - int(round(r * u.size)))
        keep = torch.zeros(u.size, dtype=torch.bool)
        keep[torch.topk(target.scores[u.name], min(n_keep, u.size)).indices] = True
        out[u.name] = keep
    return out


def member_params(model: nn.Module, unit: Unit) -> int:
    """The parameters of the modules a unit's cut touches (a member inside another counted once)."""
    paths = sorted(set(unit.members))
    top = [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]
    return sum(p.numel() for m in top for p in model.get_submodule(m).parameters())


def params_removed(model: nn.Module, target: Target, keeps: dict[str, torch.Tensor]) -> int:
    """The parameters cutting ``keeps`` removes: the domain's exact count where it has one (a
    layer cut on both sides by two units counts once), else ``Unit.params_per_channel``."""
    exact = getattr(target.domain, "params_removed", None)
    if exact is not None:
        return exact(model, keeps)
    return sum((u.size - int(keeps[u.name].sum())) * u.params_per_channel for u in target.units)


@contextlib.contextmanager
def masked(model: nn.Module, targets: list[Target], keeps: list[dict]):
    """All targets' masks at once; the model is as it was on exit."""
    with contextlib.ExitStack() as stack:
        for t, k in zip(targets, keeps):
            stack.enter_context(t.domain.masked(model, k))
        yield model


def apply(model: nn.Module, targets: list[Target], keeps: list[dict], data: list, report: PruneReport) -> None:
    """Cut every target in place, with the per-unit sparsity and the domains' warnings reported."""
    for t, k in zip(targets, keeps):
        sizes = {u.name: member_params(model, u) for u in t.units}
        t.domain.apply(model, k, data, reconstruct=t.spec.rewrites_weights)
        for u in t.units:
            kept = int(k[u.name].sum())
            after = member_params(model, u)
            if kept < u.size:
                report.record_layer_sparsity(u.name, sizes[u.name], after)
                report.add("prune", t.spec.name, u.name, f"{u.size} -> {kept}")
        for unit, choice in getattr(t.domain, "choices", []):
            report.add("recover", t.spec.name, unit, choice)
        for w in getattr(t.domain, "warnings", []):
            report.add_warning(w)
