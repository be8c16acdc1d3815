"""The search modes: the largest ratio of ``ratio_grid`` within ``tolerance`` (binary search), and
the smallest ratio that meets a parameter ``size_budget``.

Methods that only select what to keep are tried by masking the original model (one model in
memory); methods that rewrite weights, and any ``finetune_fn`` / ``quant_fn``, are tried on a
copy. The scores are computed once, on the original model, before any trial.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from openamct.pruning import core, quality
from openamct.pruning.config import parse_config
from openamct.pruning.report import PruneReport

logger = logging.getLogger(__name__)

DEFAULT_RATIO_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
DEFAULT_TOLERANCE = 0.02


@dataclass
class TrialResult:
    prune_ratio: float
    quality: float
    quality_drop: float
    params_after: int
    weight_reduction: float
    accepted: bool


@dataclass
class AutoTuneResult:
    """What a tolerance search found; ``applied``: whether the model was pruned in place."""

    chosen_ratio: float | None
    tolerance: float
    baseline_quality: float
    pruned_quality: float | None
    quality_drop: float | None
    params_before: int
    params_after: int
    weight_reduction: float
    applied: bool
    report: PruneReport | None
    trials: list[TrialResult] = field(default_factory=list)

    def summary(self) -> str:
        if self.chosen_ratio is None:
            return (f"[auto-prune] no prune ratio within tolerance {self.tolerance:.3f} "
                    f"({len(self.trials)} tried); model unchanged")
        verb = "applied" if self.applied else "suggested (not applied)"
        return (f"[auto-prune] {verb} prune_ratio={self.chosen_ratio:.2f}: params {self.params_before:,} -> "
                f"{self.params_after:,} (cut {self.weight_reduction * 100:.1f}%), quality drop "
                f"{self.quality_drop:.4f} <= {self.tolerance:.4f}")


def check_grid(ratio_grid) -> list[float]:
    grid = sorted({float(r) for r in (ratio_grid if ratio_grid is not None else DEFAULT_RATIO_GRID)})
    if not grid or grid[0] < 0 or grid[-1] >= 1:
        raise ValueError(f"ratio_grid must hold ratios in [0, 1), got {list(ratio_grid or [])}")
    return grid


def trial_quality(model, targets, keeps, batches, qf, finetune_fn=None, quant_fn=None) -> float:
    """A candidate's quality: by masks where every method only selects, else on a copy."""
    if all(t.maskable for t in targets) and finetune_fn is None and quant_fn is None:
        try:
            with core.masked(model, targets, keeps):
                return qf(model)
        except Exception as e:  # noqa: BLE001 - a candidate that fails is a rejected candidate
            logger.warning("prune search: a masked trial failed (%s: %s); it counts as unacceptable",
                           type(e).__name__, e)
            return float("-inf")
    return quality.measure_copy(model, lambda m: core.apply(m, targets, keeps, batches, PruneReport()),
                                qf, finetune_fn, quant_fn)


def _check_tolerance(tolerance) -> float:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance < 0:
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    return float(tolerance)


def tolerance_search(model, cfg, batches, tolerance, *, ratio_grid=None, report=None, apply=True,
                     evaluator=None, eval_iterations=1, eval_data=None, finetune_fn=None,
                     quant_fn=None) -> AutoTuneResult:
    """Binary search over the grid for the largest ratio whose quality drop is within tolerance."""
    tolerance = _check_tolerance(tolerance)
    grid = check_grid(ratio_grid)
    report = report if report is not None else PruneReport()
    report.backend = core.backend(model)
    before = report.params_before = core.count_params(model)
    qf, base = quality.resolve(model, evaluator, eval_iterations, eval_data or batches)
    targets = core.prepare(model, cfg, batches, report)
    trials, best, lo, hi = [], None, 0, len(grid) - 1
    while lo <= hi and targets:
        mid = (lo + hi) // 2
        keeps = [core.keep_masks(t, grid[mid]) for t in targets]
        q = trial_quality(model, targets, keeps, batches, qf, finetune_fn, quant_fn)
        removed = sum(core.params_removed(model, t, k) for t, k in zip(targets, keeps))
        ok = base - q <= tolerance
        trials.append(TrialResult(grid[mid], q, base - q, before - removed, removed / before, ok))
        report.add("search", "tolerance", f"ratio={grid[mid]}", f"quality {q:.4f} ({'accepted' if ok else 'rejected'})")
        if ok:
            best, lo = trials[-1], mid + 1
        else:
            hi = mid - 1
    if best is not None and apply:
        keeps = [core.keep_masks(t, best.prune_ratio) for t in targets]
        core.apply(model, targets, keeps, batches, report)
    report.params_after = core.count_params(model)
    report.chosen_ratio = best.prune_ratio if best else None
    if best is None:
        report.add_warning(f"no ratio of {grid} keeps the quality drop within {tolerance}; model unchanged")
    return AutoTuneResult(
        best.prune_ratio if best else None, tolerance, base, best.quality if best else None,
        best.quality_drop if best else None, before, best.params_after if best else before,
        best.weight_reduction if best else 0.0, bool(best and apply), report, trials)


def size_budget_prune(model, cfg, batches, size_budget, *, ratio_grid=None, report=None, evaluator=None,
                      eval_iterations=1, eval_data=None, finetune_fn=None, quant_fn=None) -> PruneReport:
    """The smallest ratio (one for every method in play) that leaves at most ``size_budget`` of the
    parameters; the largest ratio of the grid, flagged ``budget_unreachable``, when none does."""
    if isinstance(size_budget, bool) or not isinstance(size_budget, (int, float)) or not 0 < size_budget <= 1:
        raise ValueError(f"size_budget must be the share of parameters to keep, in (0, 1], got {size_budget!r}")
    if finetune_fn is not None or quant_fn is not None:
        raise ValueError("finetune_fn= and quant_fn= apply to tolerance= searches, not to size_budget=")
    max_ratio = check_grid(ratio_grid)[-1]
    report = report if report is not None else PruneReport()
    report.backend = core.backend(model)
    before = report.params_before = core.count_params(model)
    targets = core.prepare(model, cfg, batches, report)
    prunable = sum(u.size * u.params_per_channel for t in targets for u in t.units)
    report.prunable_fraction = prunable / before if before else 0.0
    need = before * (1 - float(size_budget))

    def removed(r):
        return sum(core.params_removed(model, t, core.keep_masks(t, r)) for t in targets)

    if removed(max_ratio) < need:
        report.budget_unreachable = True
        msg = (f"size_budget {size_budget} is out of reach: at ratio {max_ratio} the prunable structures "
               f"({report.prunable_fraction:.1%} of the parameters) leave {1 - removed(max_ratio) / before:.1%}")
        logger.warning(msg)
        report.add_warning(msg)
        ratio = max_ratio
    else:
        lo, hi = 0.0, max_ratio
        for _ in range(40):  # removed(r) is a step function of r: bisect to well below one channel
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if removed(mid) >= need else (mid, hi)
        ratio = hi
    keeps = [core.keep_masks(t, ratio) for t in targets]
    core.apply(model, targets, keeps, batches, report)
    report.params_after = core.count_params(model)
    report.chosen_ratio = ratio
    if evaluator is not None:
        q = quality.from_evaluator(evaluator, eval_iterations)(model)
        report.add("evaluate", "size_budget", "model", f"quality {q:.4f}")
    return report


def accuracy_based_auto_prune(model, config=None, *, data, tolerance=DEFAULT_TOLERANCE, evaluator=None,
                              eval_iterations=1, eval_data=None, ratio_grid=None, finetune_fn=None,
                              quant_fn=None, apply=True) -> AutoTuneResult:
    """The tolerance search as a function of its own: ``apply=False`` only reports the ratio it
    would choose (the model is left as it was)."""
    from openamct.pruning.api import calibration, check_model
    from openamct.pruning.batches import as_batches

    check_model(model)
    cfg = parse_config(config)
    batches = calibration(data, cfg)
    eval_batches = as_batches(eval_data, "eval_data") if eval_data is not None else None
    return tolerance_search(model, cfg, batches, tolerance, ratio_grid=ratio_grid, apply=apply,
                            evaluator=evaluator, eval_iterations=eval_iterations, eval_data=eval_batches,
                            finetune_fn=finetune_fn, quant_fn=quant_fn)
