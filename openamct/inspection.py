"""`openamct inspect`: what a config will do to a model, before anything is trained."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from openamct import pipeline
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.stats import count_macs, count_params
from openamct.techniques import Context
from openamct.techniques.filter_prune import FilterPruning


@dataclass
class Row:
    name: str
    type: str
    quant: str
    prune: str
    channels: str
    notes: str


@dataclass
class Inspection:
    rows: list[Row]
    params: tuple[int, int]
    macs: tuple[int, int]
    blocked: list = field(default_factory=list)


def _quant_text(lp) -> str:
    if lp.quant is None:
        return "-"
    a, w = lp.quant.act, lp.quant.wts
    clips = f"clip[{a.clip_min:g},{a.clip_max:g}]" if a.clip_max is not None else "clip:init"
    fixed = "" if a.fixed_min is None else (" fixed_min" if a.fixed_min else " free_min")
    act_type = getattr(a, "dst_type", "INT8")
    wts_type = getattr(w, "dst_type", "INT8")
    return (f"{act_type} ULQ {clips}{fixed} / {wts_type} {w.algo.upper()} "
            f"{'per-ch' if w.channel_wise else 'per-tensor'}")


def _prune_text(lp) -> str:
    if lp.filter is not None:
        return f"filter r={lp.filter.ratio:g}{' align16' if lp.filter.ascend_optimized else ''}"
    if lp.nm is not None:
        return f"2:4 update_freq={lp.nm.update_freq}"
    return "-"


def inspect_model(model: nn.Module, input_data: Any, config: str, api: str) -> Inspection:
    work = copy.deepcopy(model)
    a = pipeline.analyse(work, input_data, config, api)
    params0, macs0 = count_params(work), count_macs(work, input_data)
    before = {n: getattr(m, "out_channels", getattr(m, "out_features", None)) for n, m in work.named_modules()}
    blocked = []
    ctx = Context(work, a.graph, a.layers, a.plan, ScaleOffsetRecord(), restoring=False, input_data=input_data)
    pruning = FilterPruning()
    if pruning.wanted(ctx):  # the channel counts after pruning; nothing else changes shapes
        state = pruning.plan(ctx)
        pruning.apply(ctx, state)
        blocked = state.blocked
    after = {n: getattr(m, "out_channels", getattr(m, "out_features", None)) for n, m in work.named_modules()}
    rows = []
    for name, lp in a.plan.layers.items():
        b, c = before.get(name), after.get(name)
        channels = f"{b}" if b == c else f"{b} -> {c}"
        rows.append(Row(name, lp.type, _quant_text(lp), _prune_text(lp), channels, "; ".join(lp.notes)))
    return Inspection(rows, (params0, count_params(work)), (macs0, count_macs(work, input_data)), blocked)


def format_inspection(result: Inspection) -> str:
    headers = ("layer", "type", "quantization", "pruning", "out channels", "notes")
    table = [headers] + [(r.name, r.type, r.quant, r.prune, r.channels, r.notes) for r in result.rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    (p0, p1), (m0, m1) = result.params, result.macs
    lines.append("")
    lines.append(f"parameters: {p0:,} -> {p1:,} ({100 * (1 - p1 / max(p0, 1)):.1f}% fewer)")
    lines.append(f"MACs:       {m0:,} -> {m1:,} ({100 * (1 - m1 / max(m0, 1)):.1f}% fewer)")
    for b in result.blocked:
        lines.append(f"not pruned: group {', '.join(b.producers)}: stopped at {b.at}: {b.reason}")
    return "\n".join(lines)
