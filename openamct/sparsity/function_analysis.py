"""Function calls in the channel-dependency analysis: element-wise ops couple the groups of
their inputs (and slice per-channel parameters with them), concat joins channel spaces, axis
ops (view, permute, flatten, split) move the tracked axis, matmuls go to ``heads``; any other
use of the channel axis blocks the groups involved.
"""

from __future__ import annotations

from openamct.graph.node import Node, TensorArg, TensorInfo
from openamct.sparsity.channel_ops import (
    BINARY_FUNCTIONS,
    NO_CHANNELS,
    UNARY_FUNCTIONS,
    describe,
    node_arg,
    origin,
)
from openamct.sparsity.channel_params import PARAMETER
from openamct.sparsity.heads import MATMULS
from openamct.sparsity.index_mapping import (
    AXIS_OPS,
    RESHAPE_OPS,
    SPLIT_OPS,
    ChannelMap,
    align,
    broadcast_dim,
    dims_arg,
    follow,
)
from openamct.sparsity.owner_analysis import NORM_FUNCTIONS

__all__ = ["FunctionsMixin"]


class FunctionsMixin:
    """Methods of ``dependency._Analysis`` (state: maps, members, parent; uses ``heads``,
    ``fused_split`` and ``owner_analysis`` methods)."""

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
        elif op == "scaled_dot_product_attention":
            self.attention(node, ins)
        elif op in NORM_FUNCTIONS:
            self.norm_function(node, ins)
        elif op in ("reshape_as", "view_as") and len(ins) == 2 and ins[0] is first:
            self.shape_of(node, first, ins[1])
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

    def shape_of(self, node: Node, src: TensorInfo, like: TensorInfo) -> None:
        """``src.reshape_as(like)`` with ``like`` tracked too (LeViT's norm: ``bn(x.flatten(0, 1))
        .reshape_as(x)``): the output follows ``src``; the two must keep the same channels, so
        their layouts must line up, and their groups are coupled."""
        self.follow(node, src)
        out = self.maps.get(node.outputs[0].key)
        if out is None:
            return
        pairs = align(out, self.maps[like.key])
        if out.axis != self.maps[like.key].axis or pairs is None or any((a is None) != (b is None) for a, b in pairs):
            self.block([src, like], node.name, f"{node.op} takes its shape from a tensor whose channels do not line up")
            return
        for a, b in pairs:
            if a is not None:
                self.union(a, b)

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
                if vector is not None and len(vector.consumers) == 1:
                    params.append(vector)
                    continue
                why = (f"parameter {vector.param_name!r} holds one value per channel but is read by "
                       f"{len(vector.consumers)} ops (slicing it would change the others)" if vector is not None else
                       f"{node.op} combines the channels with a tensor no prunable layer produces "
                       f"({describe(origin(t))})")
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
        tensors = [node.inputs[a.pos] for a in node_arg(node, 0, "tensors") if isinstance(a, TensorArg)]
        out = node.outputs[0]
        axes = {self.maps[t.key].axis for t in tensors if t.key in self.maps}
        if node.op == "stack":
            dim = dims_arg(node_arg(node, 1, "dim", 0), len(out.shape))[0]
            cmap = self.couple(node, tensors, len(tensors[0].shape))
            if cmap is not None:
                self.maps[out.key] = cmap.moved(cmap.axis + (1 if dim <= cmap.axis else 0))
            return
        dim = dims_arg(node_arg(node, 1, "dim", 0), len(out.shape))[0]
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
