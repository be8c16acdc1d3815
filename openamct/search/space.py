"""What the search may decide: the coupled channel groups of filter pruning, each with the kept
counts it may take, and the MACs of every layer as a function of those counts.

The groups come from ``openamct.sparsity.dependency.analyse`` (the same analysis
``create_prune_retrain_model`` runs), so a residual add or a concat is one decision, depthwise
convs follow their input and blocked groups are never searched. MACs come from the shapes the
captured graph saw, per sample.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from openamct.config.retrain_config_pb2 import AMCTRetrainConfig
from openamct.config.source import build_plan
from openamct.graph.graph import Graph
from openamct.graph.layers import LayerInfo
from openamct.sparsity.dependency import analyse
from openamct.sparsity.filter import kept_count, select_removed
from openamct.sparsity.group import BlockedGroup, PruneGroup

logger = logging.getLogger(__name__)

__all__ = ["SearchGroup", "LayerCost", "SearchSpace", "build_space", "PLACEHOLDER_RATIO"]

PLACEHOLDER_RATIO = 0.5  # the spec searched layers carry during the analysis; never written


@dataclass
class SearchGroup:
    """One coupled group. ``options``: the kept counts it may take, largest (= unpruned) first."""

    index: int
    group: PruneGroup
    options: list[int]
    fixed: bool  # set by override_prune_cfg: not searched, pruned as the user said
    ascend_optimized: bool
    kept: int = 0
    scores: torch.Tensor | None = None  # per-channel sensitivity, higher = more important
    costs: list[float] = field(default_factory=list)  # summed sensitivity removed at each option

    @property
    def channels(self) -> int:
        return self.group.channels

    @property
    def producers(self) -> list[str]:
        return self.group.producer_names

    def ratio(self, kept: int | None = None) -> float:
        return (self.channels - (self.kept if kept is None else kept)) / self.channels

    def set_scores(self, scores: torch.Tensor) -> None:
        self.scores = scores.detach().to(torch.float64)
        self.costs = [float(self.scores[select_removed(self.scores, k, self.group.prune_group)].sum())
                      if k < self.channels else 0.0 for k in self.options]


@dataclass
class LayerCost:
    """MACs of one conv/linear call; ``out_group`` scales its output channels, each
    ``(group, repeat)`` of ``in_terms`` removes ``repeat`` input positions per removed channel."""

    name: str
    macs: int
    out_group: int | None
    out_channels: int
    in_terms: list[tuple[int, int]]
    in_channels: int

    def at(self, kept: list[int], channels: list[int]) -> float:
        out = 1.0 if self.out_group is None else kept[self.out_group] / channels[self.out_group]
        cut = sum((channels[g] - kept[g]) * r for g, r in self.in_terms)
        return self.macs * out * (self.in_channels - cut) / self.in_channels


@dataclass
class SearchSpace:
    groups: list[SearchGroup]
    layers: list[LayerCost]  # the prunable ones: their MACs depend on some group
    blocked: list[BlockedGroup]
    total_macs: int  # every conv/linear of the model, per sample

    def kept(self) -> list[int]:
        return [g.kept for g in self.groups]

    def channels(self) -> list[int]:
        return [g.channels for g in self.groups]

    def macs(self, kept: list[int] | None = None) -> float:
        kept = self.kept() if kept is None else kept
        channels = self.channels()
        return sum(c.at(kept, channels) for c in self.layers)

    def full_macs(self) -> int:
        return sum(c.macs for c in self.layers)

    def smallest(self) -> list[int]:
        return [g.kept if g.fixed else g.options[-1] for g in self.groups]

    def group_macs(self, g: int) -> float:
        """Group ``g``'s share of the prunable MACs, each layer counted once so the groups' shares
        add up to the whole: a layer's MACs go to the group pruning its outputs, and those of a
        layer whose outputs no group prunes are split evenly among the groups pruning its inputs."""
        total = 0.0
        for c in self.layers:
            if c.out_group is not None:
                total += c.macs if c.out_group == g else 0.0
            else:
                readers = sorted({t for t, _ in c.in_terms})
                total += c.macs / len(readers) if g in readers else 0.0
        return total


def _layer_macs(info: LayerInfo, graph: Graph) -> tuple[int, int, int] | None:
    """(MACs, out channels, in channels) of one call from the shapes the graph saw."""
    node = graph.call_of(info.name)
    if node is None or not node.outputs or not node.inputs:
        return None
    m, out, inp = info.module, node.outputs[0], node.inputs[0]
    if info.type == "Linear":
        return math.prod(out.shape) * m.in_features, m.out_features, m.in_features
    kernel = math.prod(m.weight.shape[2:])
    if info.type.startswith("ConvTranspose"):
        return math.prod(inp.shape) * (m.out_channels // m.groups) * kernel, m.out_channels, m.in_channels
    return math.prod(out.shape) * (m.in_channels // m.groups) * kernel, m.out_channels, m.in_channels


def search_plan(layers: dict[str, LayerInfo], override: AMCTRetrainConfig, ascend: bool,
                modules: dict[str, str], src: str):
    """The plan the analysis runs on: every layer filter-prunable under the user's skip and
    override entries, the searched ones with a placeholder ratio. Reuses the techniques' config slices and config/rules.py's priority rules."""
    cfg = AMCTRetrainConfig()
    cfg.CopyFrom(override)
    b = cfg.prune_config.filter_pruner.balanced_l2_norm_filter_prune
    b.prune_ratio, b.ascend_optimized = PLACEHOLDER_RATIO, ascend
    from openamct.techniques import TECHNIQUES

    return build_plan(cfg, layers, "prune", techniques=TECHNIQUES, modules=modules, src=src)


def fixed_layers(override: AMCTRetrainConfig, layers: dict[str, LayerInfo]) -> set[str]:
    """Layers whose filter pruning override_prune_cfg sets (they keep it, unsearched)."""
    by_name = {o.layer_name for o in override.override_layer_configs
               if o.HasField("prune_config") and o.prune_config.HasField("filter_pruner")}
    by_type = {o.layer_type for o in override.override_layer_types
               if o.HasField("prune_config") and o.prune_config.HasField("filter_pruner")}
    return {n for n, info in layers.items() if n in by_name or info.type in by_type}


def _options(channels: int, step: int, max_prune_ratio: float) -> list[int]:
    lowest = max(step, math.ceil(channels * (1 - max_prune_ratio) - 1e-9))
    lowest = math.ceil(lowest / step) * step
    top = (channels - 1) // step * step
    return [channels] + list(range(top, lowest - 1, -step))


def build_space(model: nn.Module, graph: Graph, layers: dict[str, LayerInfo], settings, *,
                align: int = 16, src: str = "override_prune_cfg", snap: int | None = None) -> SearchSpace:
    """Groups (searched and fixed) and layer costs. ``align``: the multiple kept counts snap to
    when ``ascend_optimized`` (16, as upstream's flag); without it only the groups' blocks count,
    or ``snap`` when given."""
    modules = {n: type(m).__name__ for n, m in model.named_modules()}
    plan = search_plan(layers, settings.override, settings.ascend_optimized, modules, src)
    fixed = fixed_layers(settings.override, layers)
    pruned, blocked = analyse(graph, layers, plan, model)
    groups: list[SearchGroup] = []
    for g in pruned:
        is_fixed = any(p in fixed for p in g.producer_names)
        if is_fixed:
            specs = [plan.layers[p].filter for p in g.producer_names if p in fixed]
            ratio, ascend = min(s.ratio for s in specs), any(s.ascend_optimized for s in specs)
            kept = kept_count(g.channels, ratio, ascend, g.prune_group)
            sg = SearchGroup(len(groups), g, [kept], True, ascend, kept)
        else:
            step = math.lcm(align if settings.ascend_optimized else (snap or 1), g.prune_group)
            opts = _options(g.channels, step, settings.max_prune_ratio)
            sg = SearchGroup(len(groups), g, opts, False, settings.ascend_optimized, g.channels)
        groups.append(sg)

    out_of: dict[str, int] = {}
    in_of: dict[str, list[tuple[int, int]]] = {}
    for sg in groups:
        for m in sg.group.producers:
            out_of[m.name] = sg.index
        for m in sg.group.passive:
            if m.op_type == "Conv":  # a depthwise conv: its outputs follow the group
                out_of[m.name] = sg.index
        for m in sg.group.consumers:
            in_of.setdefault(m.name, []).append((sg.index, m.repeat))
    costs, total = [], 0
    for name, info in layers.items():
        shape = _layer_macs(info, graph)
        if shape is None:
            continue
        macs, cout, cin = shape
        total += macs
        if name in out_of or name in in_of:
            costs.append(LayerCost(name, macs, out_of.get(name), cout, in_of.get(name, []), cin))
    return SearchSpace(groups, costs, blocked, total)
