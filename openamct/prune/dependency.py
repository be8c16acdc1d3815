"""Channel-dependency analysis: which layers must lose the same channels, and what stops it.

One pass over the captured graph in execution order. Every Conv/Linear call starts a
channel space (a group id); each tensor carries a ``ChannelMap`` of its tracked axis.
Channel-preserving ops pass maps on, BatchNorms, depthwise convs and per-channel parameter
owners (norms over the channels, GRN, LayerScale: ``channel_params``) come along passively,
element-wise ops between two channel-carrying tensors couple their groups (union-find),
concat joins the spaces and flatten expands them. Conv/Linear layers reading a tracked
tensor are consumers. Any other use of the channel axis blocks the groups involved.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from torch import nn

from openamct.config.specs import FilterSpec, Plan
from openamct.graph.graph import Graph
from openamct.graph.layers import LayerInfo
from openamct.graph.node import Node, TensorArg, TensorInfo
from openamct.layer_types import FILTER_TYPES, LAYER_TYPES, features
from openamct.log_summary import warn_grouped
from openamct.prune.channel_params import PARAMETER
from openamct.prune.fused_split import FusedSplitMixin
from openamct.prune.group import BlockedGroup, Member, PruneGroup
from openamct.prune.head_bias import EMBEDDING, head_embedding
from openamct.prune.heads import MATMULS, HeadsMixin
from openamct.prune.index_mapping import (
    AXIS_OPS,
    RESHAPE_OPS,
    SPLIT_OPS,
    ChannelMap,
    align,
    broadcast_dim,
    dims_arg,
    follow,
)
from openamct.prune.owner_analysis import OwnersMixin

logger = logging.getLogger(__name__)

_POOL = {f"{p}{d}d" for p in ("MaxPool", "AvgPool", "AdaptiveAvgPool", "AdaptiveMaxPool", "LPPool") for d in (1, 2, 3)}
_PAD = {f"{p}{d}d" for p in ("ZeroPad", "ConstantPad", "ReflectionPad", "ReplicationPad", "CircularPad") for d in (1, 2, 3)}
UNARY_MODULES = _POOL | _PAD | {
    "ReLU", "ReLU6", "LeakyReLU", "GELU", "SiLU", "Sigmoid", "Tanh", "Hardswish", "Hardsigmoid", "Hardtanh",
    "ELU", "SELU", "CELU", "Mish", "Softplus", "Softsign", "Tanhshrink", "Threshold", "Identity", "Dropout",
    "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout", "Upsample",
    "UpsamplingNearest2d", "UpsamplingBilinear2d"}
UNARY_FUNCTIONS = {
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "lp_pool1d",
    "lp_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d",
    "relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "hardtanh", "leaky_relu",
    "elu", "selu", "celu", "mish", "softplus", "softsign", "threshold", "dropout", "dropout1d", "dropout2d",
    "dropout3d", "alpha_dropout", "feature_alpha_dropout", "clamp", "clip", "clamp_min", "clamp_max", "neg",
    "abs", "exp", "log", "sqrt", "rsqrt", "square", "erf", "reciprocal", "sign", "floor", "ceil", "round",
    "contiguous", "clone", "detach", "to", "float", "half", "double", "bfloat16", "type", "type_as",
    "max_pool2d_with_indices", "pad", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
    "expand", "repeat"}
BINARY_FUNCTIONS = {"add": "Add", "sub": "Sub", "rsub": "Sub", "mul": "Mul", "div": "Div", "true_divide": "Div",
                    "floor_divide": None, "maximum": None, "minimum": None, "pow": None, "where": None,
                    "remainder": None, "fmod": None, "expand_as": None}
NO_CHANNELS = {"new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
               "full_like", "rand_like", "randn_like", "size", "dim", "numel"}
BATCHNORMS = {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d"}
CONSUMER_TYPES = {n: t.op_type for n, t in LAYER_TYPES.items() if t.filter}
PRODUCER_OP = {n: t.op_type for n, t in LAYER_TYPES.items()}


@dataclass
class _Source:
    name: str
    op_type: str
    channels: int
    group: int
    spec: FilterSpec | None  # None: the layer starts a channel space but is not pruned
    why_not: str = ""
    begin: int = 0  # first output row: a piece of a fused projection's output (fused_split)
    follower: bool = False  # not a layer: a per-head bias table that follows its head group (head_bias)


def _arg(node: Node, pos: int, key: str, default: object = None) -> object:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(key, default)


def _origin(t: TensorInfo) -> TensorInfo:
    """Back through dropout, activations and other one-input pass-through ops to the op that
    really made the values (an embedding's add, a LayerNorm, a graph input)."""
    while t.producer is not None and t.producer.inputs and (
            (t.producer.kind == "module" and t.producer.op in UNARY_MODULES)
            or (t.producer.kind == "function" and t.producer.op in UNARY_FUNCTIONS)):
        t = t.producer.inputs[0]
    return t


def _describe(t: TensorInfo) -> str:
    if t.producer is None:
        return f"parameter {t.param_name!r}" if t.param_name else "a constant"
    if t.producer.kind == "input":
        return f"graph input {t.producer.name!r}"
    return f"the output of {t.producer.name} ({t.producer.op})"


class _Analysis(HeadsMixin, OwnersMixin, FusedSplitMixin):
    def __init__(self, graph: Graph, layers: dict[str, LayerInfo], plan: Plan,
                 modules: dict[str, nn.Module]) -> None:
        self.graph, self.layers, self.plan, self.modules = graph, layers, plan, modules
        self.maps: dict[int, ChannelMap] = {}  # TensorInfo.key -> map of its tracked axis
        self.sources: list[_Source] = []
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

    def new_source(self, out: TensorInfo, axis: int, src: _Source) -> None:
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

    # -- modules -----------------------------------------------------------------------------
    def module(self, node: Node) -> None:
        info, ins = self.layers.get(node.name), self.tracked(node)
        if info is not None:
            self.layer(node, info, ins)
        elif not ins:
            heads = head_embedding(node, self.modules, len(self.graph.module_calls.get(node.name, [])))
            if heads is not None:  # T5's relative_attention_bias: one column per head
                out = node.outputs[0]
                self.new_source(out, len(out.shape) - 1, _Source(node.name, EMBEDDING, heads, 1, None,
                                                                 follower=True))
                self.add_members(self.maps[out.key], node.name, EMBEDDING, "passive")
        elif node.op in BATCHNORMS:
            cmap = self.maps[ins[0].key]
            if len(self.graph.module_calls.get(node.name, [])) != 1:
                self.block(ins, node.name, f"BatchNorm {node.name!r} is called more than once")
            elif cmap.axis != 1 or node.inputs[0] is not ins[0]:
                self.block(ins, node.name, "BatchNorm normalises another axis than the channels")
            else:
                self.add_members(cmap, node.name, "BatchNormalization", "passive")
                self.passthrough(node, ins[0], cmap)
        elif node.op in UNARY_MODULES and len(ins) == 1 and node.inputs[0] is ins[0]:
            self.passthrough(node, ins[0], self.maps[ins[0].key])
        elif node.name in self.modules and not (node.op in ("Flatten", "Unflatten") and len(ins) == 1):
            self.owner(node, ins)
        elif node.op in ("Flatten", "Unflatten") and len(ins) == 1:
            self.follow(node, ins[0])
        else:
            self.block(ins, node.name, f"module {node.name!r} ({node.op}) uses the channels in a way "
                                       "filter pruning cannot follow")

    def layer(self, node: Node, info: LayerInfo, ins: list[TensorInfo]) -> None:
        out = node.outputs[0] if node.outputs else None
        if info.depthwise and info.type in ("Conv1d", "Conv2d"):
            if not ins:
                return
            cmap = self.maps[ins[0].key]
            if info.excluded:
                self.block(ins, node.name, f"depthwise conv {node.name!r} is left uncompressed: {info.excluded}")
            elif cmap.axis != 1 or node.inputs[0] is not ins[0]:
                self.block(ins, node.name, "depthwise conv input is not tracked on its channel axis")
            elif out is not None:
                mult = info.module.out_channels // info.module.in_channels
                out_map = cmap.expanded(mult)
                self.add_members(out_map, node.name, "Conv", "passive", info.groups)
                self.maps[out.key] = out_map
            return
        if ins:
            self.consume(node, info, ins)
        if out is None or info.type not in PRODUCER_OP:
            return
        m = info.module
        transposed = info.type.startswith("ConvTranspose")  # (Conv1D: a matrix layer, no groups)
        channels = features(m)[1] if info.matrix else m.out_channels
        lp = self.plan.layers.get(node.name)
        active = lp is not None and not info.excluded and info.type in FILTER_TYPES
        spec = lp.filter if active else None
        why = (f"which is left uncompressed ({info.excluded})" if info.excluded
               else "which the config does not prune")
        group = 1 if info.matrix or transposed else info.groups
        axis = len(out.shape) - 1 if info.matrix else 1
        self.new_source(out, axis, _Source(node.name, PRODUCER_OP[info.type], channels, group, spec, why))

    def consume(self, node: Node, info: LayerInfo, ins: list[TensorInfo]) -> None:
        cmap = self.maps[ins[0].key]
        want = len(ins[0].shape) - 1 if info.matrix else 1
        if info.excluded:
            self.block(ins, node.name, f"consumer {node.name!r} is left uncompressed: {info.excluded}")
            return
        if info.type not in CONSUMER_TYPES:
            self.block(ins, node.name, f"{info.type} {node.name!r} cannot have its input channels pruned")
            return
        if len(ins) > 1 or node.inputs[0] is not ins[0] or cmap.axis != want:
            self.block(ins, node.name, f"{info.type} {node.name!r} does not read the channels on its input "
                                       "channel axis")
            return
        groups = 1 if info.matrix else info.groups
        if groups > 1:
            blk = info.module.in_channels // groups
            for seg, offset in cmap.placed():
                if offset % blk or seg.size % blk or blk % seg.repeat:
                    self.block(ins, node.name, f"grouped {info.type} {node.name!r} (groups={groups}) splits "
                                               "the channels unevenly")
                    return
        if groups > 1:
            for seg, _ in cmap.placed():
                self.folds[seg.gid].append(seg.size // blk)
        self.add_members(cmap, node.name, CONSUMER_TYPES[info.type], "consumer", groups)

    # -- functions ---------------------------------------------------------------------------
    def function(self, node: Node) -> None:
        ins, op, first = self.tracked(node), node.op, (node.inputs or [None])[0]
        if not ins or op in NO_CHANNELS:
            return
        if op in BINARY_FUNCTIONS or op in ("max", "min") and len(node.inputs) > 1:
            out_map = self.couple(node, list(node.inputs), len(node.outputs[0].shape))
            if out_map is not None:
                self.maps[node.outputs[0].key] = out_map
                if BINARY_FUNCTIONS.get(op):
                    self.add_members(out_map, node.name, BINARY_FUNCTIONS[op], "passive")
        elif op in ("cat", "concat", "concatenate", "stack"):
            self.concat(node)
        elif op in MATMULS:
            self.matmul(node, ins)
        elif ins != [first] and not (op == "type_as" and ins[0] is first):
            self.block(ins, node.name, f"{op} uses the channels of a second tensor argument")
        elif op in UNARY_FUNCTIONS:
            self.passthrough(node, first, self.maps[first.key])
        elif op in AXIS_OPS:
            self.follow(node, first)
        else:
            self.block(ins, node.name, f"{op} is not an op channel pruning can pass through")

    def follow(self, node: Node, src: TensorInfo) -> None:
        cmap = self.maps[src.key]
        moved = follow(node.op, node.args, node.kwargs, src.shape, node.outputs[0].shape, cmap.axis)
        if isinstance(moved, str) and node.op in SPLIT_OPS:
            moved = self.split_channels(node, src) or None  # fused Q/K/V: c_attn(x).split(size, dim)
            if moved is None:
                return
        if isinstance(moved, str) and node.op in RESHAPE_OPS:
            moved = self.split_heads(node, src) or None  # attention heads: view(..., -1, head_dim)
        if isinstance(moved, str):
            self.block([src], node.name, moved)
            return
        if moved is None:
            return
        axis, factor = moved
        for out in node.outputs:
            if axis >= len(out.shape) or out.shape[axis] != src.shape[cmap.axis] * factor:
                self.block([src], node.name, f"{node.op} changes the channel axis")
                return
        for out in node.outputs:
            self.maps[out.key] = cmap.expanded(factor).moved(axis)
        if factor > 1 and (why := self.size_attribute(node, axis, self.maps[node.outputs[0].key])):
            self.block([src], node.name, why)

    def couple(self, node: Node, inputs: list[TensorInfo], ndim: int) -> ChannelMap | None:
        """Element-wise use (or concat on another axis): every input that carries the channel
        axis must carry the same layout, and then their groups are coupled. Returns the map of
        the (broadcast, ``ndim``-dimensional) result, None when blocked."""
        # a 1-channel tensor broadcast over the channels (a per-sample scale) couples nothing
        tracked = {t.key: self.maps[t.key] for t in inputs
                   if t.key in self.maps and t.shape[self.maps[t.key].axis] > 1}
        if not tracked:
            return None
        axes = {ndim - len(t.shape) + tracked[t.key].axis for t in inputs if t.key in tracked}
        if len(axes) != 1:
            self.block(inputs, node.name, f"{node.op} combines tensors tracked on different axes")
            return None
        axis, ref = axes.pop(), next(iter(tracked.values()))
        params = []  # per-channel parameters (LayerScale): sliced with the channels
        for t in inputs:
            if t.key not in tracked:
                if broadcast_dim(t.shape, ndim, axis) is None:
                    continue
                vector = self.per_channel_param(node, t, ndim, axis, ref.size)
                if vector and len(t.consumers) == 1:
                    params.append(t)
                    continue
                why = (f"parameter {t.param_name!r} holds one value per channel but is read by {len(t.consumers)} "
                       "ops (slicing it would change the others)" if vector else
                       f"{node.op} combines the channels with a tensor no prunable layer produces "
                       f"({_describe(_origin(t))})")
                self.block(inputs, node.name, why)
                return None
            pairs = align(ref, tracked[t.key])
            if pairs is None or any((a is None) != (b is None) for a, b in pairs):
                self.block(inputs, node.name, f"{node.op} combines channel layouts that do not line up")
                return None
        for m in tracked.values():
            for a, b in align(ref, m):
                if a is not None:
                    self.union(a, b)
        for t in params:
            self.add_members(ref, t.param_name, PARAMETER, "passive")
        return ref.moved(axis)

    def concat(self, node: Node) -> None:
        tensors = [node.inputs[a.pos] for a in _arg(node, 0, "tensors") if isinstance(a, TensorArg)]
        out = node.outputs[0]
        axes = {self.maps[t.key].axis for t in tensors if t.key in self.maps}
        if node.op == "stack":
            dim = dims_arg(_arg(node, 1, "dim", 0), len(out.shape))[0]
            cmap = self.couple(node, tensors, len(tensors[0].shape))
            if cmap is not None:
                self.maps[out.key] = cmap.moved(cmap.axis + (1 if dim <= cmap.axis else 0))
            return
        dim = dims_arg(_arg(node, 1, "dim", 0), len(out.shape))[0]
        if axes != {dim}:
            if dim in axes:
                self.block(tensors, node.name, "cat mixes the channel axis with another axis")
            else:
                cmap = self.couple(node, tensors, len(out.shape))
                if cmap is not None:
                    self.maps[out.key] = cmap
            return
        joined = ChannelMap.joined(dim, [self.maps.get(t.key) or t.shape[dim] for t in tensors])
        self.add_members(joined, node.name, "Concat", "passive")
        self.maps[out.key] = joined

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

    def make_group(self, gids: list[int], srcs: list[_Source], prune_group: int, every: list[int]) -> PruneGroup:
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
