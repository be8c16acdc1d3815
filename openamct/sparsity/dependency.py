"""Channel-dependency analysis: which layers must lose the same channels, and what stops it.

One pass over the captured graph in execution order. Every Conv/Linear call starts a
channel space (a group id); each tensor carries a ``ChannelMap`` of its tracked axis.
Channel-preserving ops pass maps on, BatchNorms, depthwise convs and per-channel parameter
owners (norms over the channels, GRN, LayerScale: ``channel_params``) come along passively,
element-wise ops between two channel-carrying tensors couple their groups (union-find),
concat joins the spaces and flatten expands them. Conv/Linear layers reading a tracked
tensor are consumers. Any other use of the channel axis blocks the groups involved.

Here: the union-find, the bookkeeping and the result. Module calls are followed in
``module_analysis``, function calls in ``function_analysis`` (op tables: ``channel_ops``),
attention heads in ``heads``, fused projections in ``fused_split``, parameter owners in
``owner_analysis``.
"""

from __future__ import annotations

import logging
import math

from torch import nn

from openamct.config.specs import Plan
from openamct.graph.graph import Graph
from openamct.graph.layers import LayerInfo
from openamct.graph.node import Node, TensorInfo
from openamct.log_summary import warn_grouped
from openamct.sparsity.function_analysis import FunctionsMixin
from openamct.sparsity.fused_split import FusedSplitMixin
from openamct.sparsity.group import BlockedGroup, Member, PruneGroup
from openamct.sparsity.heads import HeadsMixin
from openamct.sparsity.index_mapping import ChannelMap
from openamct.sparsity.module_analysis import ModulesMixin, Source
from openamct.sparsity.owner_analysis import OwnersMixin

logger = logging.getLogger(__name__)


class _Analysis(ModulesMixin, FunctionsMixin, HeadsMixin, OwnersMixin, FusedSplitMixin):
    def __init__(self, graph: Graph, layers: dict[str, LayerInfo], plan: Plan,
                 modules: dict[str, nn.Module]) -> None:
        self.graph, self.layers, self.plan, self.modules = graph, layers, plan, modules
        self.maps: dict[int, ChannelMap] = {}  # TensorInfo.key -> map of its tracked axis
        self.sources: list[Source] = []
        self.parent: list[int] = []
        self.unit: list[int] = []  # gid -> consecutive output channels per unit (a head: head_dim)
        self.blocks: dict[int, tuple[int, str, str]] = {}  # gid -> (node order, at, reason)
        self.members: dict[int, list[tuple[int, Member]]] = {}  # gid -> (node order, member)
        self.folds: dict[int, list[int]] = {}  # gid -> block counts removal must be equal over
        self.order = 0

    # -- union-find and bookkeeping ---------------------------------------------------------
    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def block(self, tensors: list[TensorInfo], at: str, reason: str) -> None:
        for t in tensors:
            cmap = self.maps.get(t.key)
            for g in cmap.gids() if cmap else ():
                self.blocks.setdefault(g, (self.order, at, reason))

    def add_members(self, cmap: ChannelMap, name: str, op_type: str, role: str, group: int = 1) -> None:
        for seg, offset in cmap.placed():
            self.members[seg.gid].append(
                (self.order, Member(name, op_type, offset, offset + seg.size, seg.repeat, group, role)))

    def new_source(self, out: TensorInfo, axis: int, src: Source) -> None:
        gid = len(self.sources)
        self.sources.append(src)
        self.parent.append(gid)
        self.unit.append(1)
        self.members[gid], self.folds[gid] = [], []
        if src.group > 1:
            self.folds[gid].append(src.group)
        self.maps[out.key] = ChannelMap.source(gid, axis, src.channels)

    def tracked(self, node: Node) -> list[TensorInfo]:
        return [t for t in node.inputs if t.key in self.maps]

    def passthrough(self, node: Node, src: TensorInfo, cmap: ChannelMap) -> None:
        """Outputs keep the channel axis where it was; anything else that changed blocks."""
        for out in node.outputs:
            if len(out.shape) != len(src.shape) or out.shape[cmap.axis] != src.shape[cmap.axis]:
                self.block([src], node.name, f"{node.op} changes the channel axis")
                return
        for out in node.outputs:
            self.maps[out.key] = cmap

    # -- result --------------------------------------------------------------------------------
    def run(self) -> tuple[list[PruneGroup], list[BlockedGroup]]:
        for order, node in enumerate(self.graph.nodes):
            self.order = order
            if node.kind == "module":
                self.module(node)
            elif node.kind == "function":
                self.function(node)
            elif node.kind == "output":
                self.block(node.inputs, "output", "the channels reach the graph output")
        return self.collect()

    def collect(self) -> tuple[list[PruneGroup], list[BlockedGroup]]:
        roots: dict[int, list[int]] = {}
        for g in range(len(self.sources)):
            roots.setdefault(self.find(g), []).append(g)
        groups, blocked = [], []
        for every in roots.values():
            gids = [g for g in every if not self.sources[g].follower]  # followers join, they do not decide
            srcs = [self.sources[g] for g in gids]
            if not any(s.spec for s in srcs):
                continue
            names = [s.name for s in srcs]
            stops = sorted(self.blocks[g] for g in every if g in self.blocks)
            idle = [s for s in srcs if s.spec is None]
            prune_group = math.lcm(1, *(f for g in every for f in self.folds[g]))
            if stops:
                at, reason = stops[0][1], stops[0][2]
            elif idle:
                at, reason = idle[0].name, f"coupled with {idle[0].name}, {idle[0].why_not}"
            elif srcs[0].channels % prune_group:
                at, reason = names[0], (f"{srcs[0].channels} channels cannot be split into {prune_group} "
                                        "equal blocks (grouped convs)")
            else:
                groups.append(self.make_group(gids, srcs, prune_group, every))
                continue
            blocked.append(BlockedGroup(names, at, reason))
        warn_grouped(logger, "filter prune: group(s) not pruned",
                     [(f"{', '.join(b.producers)} (stopped at {b.at})", b.reason) for b in blocked])
        return groups, blocked

    def make_group(self, gids: list[int], srcs: list[Source], prune_group: int, every: list[int]) -> PruneGroup:
        specs = [s.spec for s in srcs]
        ratio, ascend = min(s.ratio for s in specs), any(s.ascend_optimized for s in specs)
        if len({(s.ratio, s.ascend_optimized) for s in specs}) > 1:
            logger.info("filter prune: coupled layers %s have different settings; the group uses "
                        "prune_ratio %g (the smallest), ascend_optimized %s (any)",
                        ", ".join(s.name for s in srcs), ratio, ascend)
        producers = [Member(s.name, s.op_type, s.begin, s.begin + s.channels * self.unit[g], self.unit[g], s.group,
                            "producer")
                     for g, s in zip(gids, srcs, strict=True)]
        seen, passive, consumers = set(), [], []
        for _, m in sorted((x for g in every for x in self.members[g]), key=lambda x: x[0]):
            key = (m.name, m.begin, m.end, m.role)
            if key not in seen:
                seen.add(key)
                (passive if m.role == "passive" else consumers).append(m)
        return PruneGroup(producers, consumers, passive, srcs[0].channels, prune_group, ratio, ascend)


def analyse(graph: Graph, layers: dict[str, LayerInfo], plan: Plan, model: nn.Module | None = None,
            ) -> tuple[list[PruneGroup], list[BlockedGroup]]:
    """Coupled channel groups of the layers ``plan`` filter-prunes, and the groups that cannot
    be pruned (each logged once with the node that stops it and why). ``model`` (the one the
    graph was captured from) lets per-channel parameter owners follow; without it they block."""
    groups, blocked = _Analysis(graph, layers, plan, dict(model.named_modules()) if model is not None else {}).run()
    unseen = [name for name in layers if not graph.module_calls.get(name)]
    if groups and unseen:
        # The graph is the path input_data took in eval mode: a training-only branch or the
        # other side of an if never showed up, so nothing here knows what it reads.
        logger.warning("filter prune: layers %s never ran with input_data; if the model runs them on other "
                       "inputs or in training mode, they may read pruned channels and fail",
                       ", ".join(repr(n) for n in unseen[:5]) + (" ..." if len(unseen) > 5 else ""))
    return groups, blocked
