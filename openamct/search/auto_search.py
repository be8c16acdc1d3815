"""``auto_channel_prune_search``: per-group prune ratios for a compute budget, written as a
retrain config that ``create_prune_retrain_model`` / ``create_compressed_retrain_model`` take.

config (AutoChannelPruneConfig) ─ checked first, with input_data and output_cfg
  → deep copy of the model → graph capture on one sample → groups + MACs (``space``)
  → budget reachable? (else ValueError naming compress_ratio) → sensitivity per channel
  → search (kept count per group) → output_cfg written atomically → SearchReport
"""

from __future__ import annotations

import contextlib
import copy
import logging
import tempfile
import time
from typing import Any

import torch
from torch import nn

from openamct.graph.capture import capture_graph, flatten_tensors
from openamct.graph.layers import find_layers
from openamct.search.budget import Budget
from openamct.search.greedy import resolve_search_alg
from openamct.search.report import GroupRow, SearchReport
from openamct.search.search_config import (
    SearchSettings,
    check_output_path,
    load_search_config,
    write_retrain_config,
)
from openamct.search.sensitivity import resolve_sensitivity
from openamct.search.space import SearchSpace, build_space, fixed_layers

logger = logging.getLogger(__name__)

__all__ = ["BUDGETS", "check_batches", "upstream_pair", "run_search"]

BUDGETS = ("macs", "latency")


def upstream_pair(input_data: Any, test_iteration: int) -> list[tuple[Any, torch.Tensor]] | None:
    """Upstream's form, one ``[data, label]`` pair of tensors (``x_data, y_label =
    input_data``), as the ``[data, label]`` batches upstream's sensitivity reads from it: the
    first ``test_iteration`` samples, one per iteration. None for any other form."""
    if not (isinstance(input_data, (list, tuple)) and len(input_data) == 2
            and all(isinstance(t, torch.Tensor) for t in input_data)):
        return None
    data, label = input_data
    if data.dim() == 0 or label.dim() == 0:
        raise ValueError("input_data: a [data, label] pair needs a batch axis on both tensors")
    if min(len(data), len(label)) < test_iteration:
        raise ValueError(f"input_data: test_iteration {test_iteration} reads one sample per iteration, and the "
                         f"[data, label] pair holds {min(len(data), len(label))}: give more samples or lower "
                         "test_iteration")
    return [(data[i:i + 1], label[i:i + 1]) for i in range(test_iteration)]


def check_batches(input_data: Any) -> list[tuple[Any, torch.Tensor]]:
    """``input_data`` must be a non-empty list of ``[data, label]`` pairs of tensors."""
    if not isinstance(input_data, (list, tuple)) or not input_data:
        raise TypeError("input_data must be a non-empty list of [data, label] batches (torch tensors), "
                        f"got {type(input_data).__name__}")
    out = []
    for i, item in enumerate(input_data):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            got = f"a {type(item).__name__} of length {len(item)}" if isinstance(item, (list, tuple)) else \
                type(item).__name__
            raise TypeError(f"input_data[{i}] must be a [data, label] pair, got {got}")
        data, label = item
        if not flatten_tensors(data) or not isinstance(data, (torch.Tensor, list, tuple, dict)):
            raise TypeError(f"input_data[{i}][0] (data) must be a tensor or a tuple of tensors, "
                            f"got {type(data).__name__}")
        if not isinstance(label, torch.Tensor):
            raise TypeError(f"input_data[{i}][1] (label) must be a tensor, got {type(label).__name__}")
        out.append((data, label))
    return out


def _first_sample(data: Any) -> Any:
    """The same structure with every tensor cut to its first row: MACs are counted per sample."""
    if isinstance(data, torch.Tensor):
        return data[:1]
    if isinstance(data, (list, tuple)):
        return type(data)(_first_sample(d) for d in data)
    if isinstance(data, dict):
        return {k: _first_sample(v) for k, v in data.items()}
    return data


def _macs_budget(space: SearchSpace, settings: SearchSettings) -> Budget:
    full, start = space.full_macs(), space.macs()
    best = space.macs(space.smallest())
    reachable = full / best if best > 0 else float("inf")
    if reachable < settings.compress_ratio:
        searched = sum(1 for g in space.groups if not g.fixed and len(g.options) > 1)
        raise ValueError(
            f"config {settings.path!r}: compress_ratio {settings.compress_ratio:g} cannot be met: the {searched} "
            f"searchable group(s) at their smallest (max_prune_ratio {settings.max_prune_ratio:g}, "
            f"ascend_optimized {str(settings.ascend_optimized).lower()}) give at most {reachable:.3g}x fewer MACs "
            f"({full:,} -> {best:,.0f} per sample over the prunable layers)")
    if start < full:
        logger.info("override_prune_cfg groups already take the prunable MACs from %d to %.0f", full, start)
    return Budget(space.macs, full, full / settings.compress_ratio, "MACs")


def run_search(model: nn.Module, config: str, input_data: Any, output_cfg: str,
               sensitivity: Any = "TaylorLossSensitivity", search_alg: Any = "GreedySearch",
               budget: str = "macs") -> SearchReport:
    t0 = time.perf_counter()
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    settings = load_search_config(config)
    check_output_path(output_cfg, {"config": config, "override_prune_cfg": settings.override_path})
    batches = upstream_pair(input_data, settings.test_iteration) or check_batches(input_data)
    if settings.test_iteration > len(batches):
        raise ValueError(f"config {config!r}: test_iteration {settings.test_iteration} needs that many batches, "
                         f"input_data has {len(batches)}")
    sens, alg = resolve_sensitivity(sensitivity), resolve_search_alg(search_alg)

    work = copy.deepcopy(model)
    sample = _first_sample(batches[0][0])
    graph = capture_graph(work, sample)
    layers = find_layers(work, graph)
    src = f"override_prune_cfg {settings.override_path!r}" if settings.override_path else "config"
    # the latency budget snaps kept counts to multiples of 8 even without ascend_optimized (16)
    space = build_space(work, graph, layers, settings, align=16, src=src, snap=8 if budget == "latency" else None)
    searched = [g for g in space.groups if not g.fixed and len(g.options) > 1]
    if not any(not g.fixed for g in space.groups):
        raise ValueError(f"config {config!r}: no layer of {type(model).__name__} can be searched: "
                         + ("; ".join(b.describe() for b in space.blocked[:3]) or "no prunable Conv2d/Linear layers"))
    with contextlib.ExitStack() as stack:  # the latency budget's ONNX folder goes on every path out
        if budget == "macs":
            plan = _macs_budget(space, settings)
        else:  # onnx is loaded for the latency budget only
            from openamct.search.latency import latency_budget, refine

            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="openamct-latency-"))
            plan = latency_budget(work, sample, graph, space, settings, folder)
        _set_scores(sens, work, batches[:settings.test_iteration], searched, space)
        _set_kept(alg, space, plan)
        report = _report(space, settings, plan, budget, output_cfg)
        if budget == "latency":
            refine(work, sample, space, settings, plan, alg, report)
    user_set = fixed_layers(settings.override, layers)
    ratios = {}
    for g in space.groups:
        if g.kept < g.channels:  # a residual group: one ratio on all its producers
            # producers coupled with an overridden layer take its ratio (else create blocks them)
            ratio = float(f"{g.ratio():.6g}")
            ratios.update({p: (ratio, g.ascend_optimized) for p in g.producers if p not in user_set})
    report.rows = _rows(space)
    report.macs_after = space.macs()
    report.model_macs_after = report.model_macs_before - (space.full_macs() - report.macs_after)
    report.seconds = time.perf_counter() - t0
    header = (f"Written by openamct auto_channel_prune_search from {config} (budget {budget}, compress_ratio "
              f"{settings.compress_ratio:g}).\nMACs of the prunable layers per sample: {report.macs_before:,} -> "
              f"{report.macs_after:,.0f} ({report.macs_ratio:.2f}x fewer).")
    write_retrain_config(output_cfg, settings.override, ratios, header)
    logger.info("auto_channel_prune_search: %s written in %.1f s", output_cfg, report.seconds)
    return report


def _set_scores(sens, work: nn.Module, batches, searched, space: SearchSpace) -> None:
    """Each searched group's channel scores from ``sens``, checked; zeros for the others."""
    scores = sens.channel_scores(work, batches, [g.group for g in searched])
    if not isinstance(scores, (list, tuple)) or len(scores) != len(searched):
        raise ValueError(f"sensitivity {type(sens).__name__}.channel_scores must return one tensor per group "
                         f"({len(searched)}), got {type(scores).__name__}")
    for g, s in zip(searched, scores):
        s = torch.as_tensor(s).detach().to(torch.float64).reshape(-1)
        if s.numel() != g.channels or not torch.isfinite(s).all():
            raise ValueError(f"sensitivity {type(sens).__name__}: the scores of group {', '.join(g.producers)} must "
                             f"be {g.channels} finite numbers, got {s.numel()}")
        g.set_scores(s)
    for g in space.groups:
        if g.scores is None:
            g.set_scores(torch.zeros(g.channels, dtype=torch.float64))


def _set_kept(alg, space: SearchSpace, plan: Budget) -> None:
    """The kept count per group from ``alg``, checked against the options and the budget."""
    kept = alg.search(space, plan.cost, plan.target)
    if len(kept) != len(space.groups):
        raise ValueError(f"search_alg {type(alg).__name__} returned {len(kept)} kept counts for {len(space.groups)} groups")
    for g, k in zip(space.groups, kept, strict=True):
        if k not in g.options:
            raise ValueError(f"search_alg {type(alg).__name__} chose {k} channels for {', '.join(g.producers)}; "
                             f"allowed: {g.options[:6]}{' ...' if len(g.options) > 6 else ''}")
        g.kept = k
    if plan.cost(kept) > plan.target * (1 + 1e-9):
        raise ValueError(f"search_alg {type(alg).__name__} missed the budget: {plan.cost(kept):.4g} {plan.unit} "
                         f"> {plan.target:.4g}")


def _rows(space: SearchSpace) -> list[GroupRow]:
    full = space.full_macs() or 1
    rows = []
    for g in space.groups:
        s = g.scores if g.scores is not None else torch.zeros(1, dtype=torch.float64)
        lost = g.costs[g.options.index(g.kept)] if g.costs and g.kept in g.options else 0.0
        rows.append(GroupRow(g.producers, g.channels, g.kept, g.ratio(), float(s.mean()),
                             lost / float(s.sum()) if float(s.sum()) > 0 else 0.0,
                             space.group_macs(g.index) / full, g.fixed, len(g.options) > 1))
    return rows


def _report(space: SearchSpace, settings: SearchSettings, plan, budget: str, output_cfg: str) -> SearchReport:
    return SearchReport(budget=budget, compress_ratio=settings.compress_ratio, output_cfg=output_cfg,
                        macs_before=space.full_macs(), macs_after=space.macs(), model_macs_before=space.total_macs,
                        model_macs_after=space.total_macs, blocked=[b.describe() for b in space.blocked])
