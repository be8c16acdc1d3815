"""Per-unit ratios by sensitivity, and the menu: pick among method candidates on a copy each.

Sensitivity: each unit alone is masked at ``ref_ratio`` and the output distortion against the
original is read (masks, whatever the method: the probe asks how much the unit's channels
matter, not how well a rewrite recovers them). Ratios go inversely to that distortion, scaled so
that the parameter-weighted mean ratio is ``ref_ratio``, within ``[min_ratio, max_ratio]``. With
``guard="calib_nll"`` the allocation is kept only if its distortion on the calibration data is
below the uniform ``ref_ratio``'s; ``report.allocation_choice`` says which was applied.
"""

from __future__ import annotations

import copy
import logging

from openamct.pruning import core, quality
from openamct.pruning.report import PruneReport

logger = logging.getLogger(__name__)


def _allocate(units, sens: dict[str, float], ref: float, lo: float, hi: float) -> dict[str, float]:
    weight = {u.name: u.size * u.params_per_channel for u in units}
    total = sum(weight.values())
    inv = {n: 1.0 / (s + 1e-9) for n, s in sens.items()}
    scale = ref
    for _ in range(50):  # fixed point: the clipping moves the weighted mean, rescale until it holds
        mean_inv = sum(weight[n] * inv[n] for n in inv) / total
        ratios = {n: min(hi, max(lo, scale * inv[n] / mean_inv)) for n in inv}
        got = sum(weight[n] * ratios[n] for n in inv) / total
        if abs(got - ref) < 1e-4 or got == 0:
            break
        scale *= ref / got
    return ratios


def sensitivity_prune(model, cfg, batches, *, report: PruneReport, evaluator=None, eval_iterations=1,
                      eval_data=None) -> PruneReport:
    alloc = cfg.allocation
    ref, lo, hi = alloc["ref_ratio"], alloc["min_ratio"], alloc["max_ratio"]
    if not lo <= ref <= hi:
        raise ValueError(f"config['allocation']: need min_ratio <= ref_ratio <= max_ratio, got {lo}, {ref}, {hi}")
    report.backend = core.backend(model)
    report.params_before = core.count_params(model)
    targets = core.prepare(model, cfg, batches, report)
    dist = quality.distortion(model, eval_data or batches)
    ratios = {}
    for t in targets:
        sens = {}
        for u in t.units:
            keep = core.keep_masks(t, {v.name: (ref if v.name == u.name else 0.0) for v in t.units})
            with t.domain.masked(model, {u.name: keep[u.name]}):
                sens[u.name] = dist(model)
        report.add("sensitivity", t.spec.name, t.spec.domain,
                   ", ".join(f"{n}={s:.3g}" for n, s in sens.items()))
        ratios.update(_allocate(t.units, sens, ref, lo, hi))
    choice = "sensitivity"
    if alloc["guard"] == "calib_nll" and targets:
        keeps_s = [core.keep_masks(t, ratios) for t in targets]
        keeps_u = [core.keep_masks(t, ref) for t in targets]
        d = []
        for keeps in (keeps_s, keeps_u):
            if all(t.maskable for t in targets):
                with core.masked(model, targets, keeps):
                    d.append(dist(model))
            else:
                d.append(-quality.measure_copy(model, lambda m, k=keeps: core.apply(m, targets, k, batches,
                                                                                    PruneReport()),
                                               lambda m: -dist(m)))
        if d[0] >= d[1]:
            choice, ratios = "uniform", {n: ref for n in ratios}
        report.add("guard", "calib_nll", "allocation", f"sensitivity {d[0]:.4g} vs uniform {d[1]:.4g}")
    report.allocation_choice = choice
    keeps = [core.keep_masks(t, ratios) for t in targets]
    core.apply(model, targets, keeps, batches, report)
    report.params_after = core.count_params(model)
    return report


def menu_prune(model, cfg, batches, *, report: PruneReport, evaluator=None, eval_iterations=1, eval_data=None,
               finetune_fn=None, quant_fn=None) -> PruneReport:
    """Each candidate of the menu on a copy, measured on ``eval_data`` (else the calibration data);
    the first candidate is the fallback, replaced only by a strictly better one."""
    from openamct.pruning.api import prune_fixed

    domain = cfg.menu_domain
    qf, _ = quality.resolve(model, evaluator, eval_iterations, eval_data or batches)
    results = []
    for label, spec in cfg.methods[domain].menu:
        one = copy.copy(cfg)
        one.methods = {domain: spec}
        q = quality.measure_copy(model, lambda m, c=one: prune_fixed(m, c, batches, PruneReport()), qf,
                                 finetune_fn, quant_fn)
        results.append((label, one, q))
        report.add("menu", spec.name, label, f"quality {q:.4f}")
    best = results[0]
    for r in results[1:]:
        if r[2] > best[2]:
            best = r
    report.allocation_choice = None
    report.add("menu", "choice", domain, best[0])
    prune_fixed(model, best[1], batches, report)
    return report
