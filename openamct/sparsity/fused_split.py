"""Fused projections in channel-dependency analysis: one layer whose output is split along its
channel axis into equal pieces (GPT-2's ``c_attn(x).split(self.split_size, dim=2)`` into Q, K
and V; a ``chunk(3, -1)``).

Why the pieces become sources of their own: each piece is a tensor like a separate projection's
output (Q, K or V, head-structured), so everything downstream (the head view, Q·Kᵀ, softmax·V,
the merge into O) is followed as for three Linears. The layer is then a producer several
times over, once per piece, at offsets ``i * size`` of its output rows (``module_analysis.Source.begin``); the
removal is the union of the pieces' rows, so one module edit cuts all three consistently.

Why the pieces are coupled at once: a split by one size (``split_size``) or into ``chunks``
equal pieces only splits the pruned output the same way if every piece keeps as many channels,
and coupling (same channels removed in each) guarantees it. A size written out is read from
the module (``split_size``); that attribute follows the kept count like ``all_head_size``.
"""

from __future__ import annotations

from dataclasses import replace

from openamct.graph.node import Node, TensorInfo
from openamct.sparsity.channel_params import ATTRIBUTE
from openamct.sparsity.index_mapping import ChannelMap

SPLIT_ATTRS = ("split_size",)
FUSED_SPLIT_OPS = ("split", "chunk")


class FusedSplitMixin:
    """Methods of ``dependency._Analysis`` (state: sources, members, folds, maps, unit, modules)."""

    def split_channels(self, node: Node, src: TensorInfo) -> str:
        """A split/chunk of a layer's own output along its channel axis into equal pieces:
        each piece becomes a source of the same layer at its offset; '' or why not."""
        cmap, outs = self.maps[src.key], node.outputs
        where = repr(node.scope) if node.scope else "the top-level module"
        if node.op not in FUSED_SPLIT_OPS:
            return f"{node.op} cuts the channel axis"
        sizes = {o.shape[cmap.axis] if len(o.shape) == len(src.shape) else -1 for o in outs}
        if len(outs) < 2 or len(sizes) != 1 or -1 in sizes:
            return f"{node.op} in {where} cuts the channel axis into unequal pieces"
        g = self.whole_output(src)
        if g is None:
            return (f"{node.op} in {where} cuts the channel axis of a tensor that is not one layer's output "
                    "read only by the split")
        size = sizes.pop()
        attr = None
        if node.op == "split":
            value = node.args[1] if len(node.args) > 1 else node.kwargs.get(
                "split_size", node.kwargs.get("split_size_or_sections"))
            owner = self.modules.get(node.scope)
            attr = next((a for a in SPLIT_ATTRS if owner is not None and type(getattr(owner, a, None)) is int
                         and getattr(owner, a) == size), None)
            if type(value) is not int or attr is None:
                return (f"split in {where} cuts the channels into pieces of {size} written out, and {where} "
                        f"has no attribute {'/'.join(SPLIT_ATTRS)} = {size} to update: the pieces would not "
                        "follow pruning")
        first = self.sources[g]
        first.channels = size
        self.maps[outs[0].key] = ChannelMap.source(g, cmap.axis, size)
        for i, out in enumerate(outs[1:], 1):
            self.new_source(out, cmap.axis, replace(first, begin=first.begin + i * size))
            self.union(g, len(self.sources) - 1)
        if attr is not None:
            self.add_members(ChannelMap.source(g, cmap.axis, size), f"{node.scope}.{attr}", ATTRIBUTE, "passive")
        return ""

    def whole_output(self, src: TensorInfo) -> int | None:
        """The gid of the layer whose whole, untouched output ``src`` is (read by one op only,
        coupled with nothing yet), or None."""
        cmap = self.maps[src.key]
        (seg,) = cmap.segments if len(cmap.segments) == 1 else (None,)
        g = seg.gid if seg is not None else None
        if (g is None or seg.repeat != 1 or src.producer is None or src.producer.name != self.sources[g].name
                or len(src.consumers) != 1 or self.unit[g] != 1 or self.members[g] or self.folds[g]
                or any(self.find(x) == self.find(g) for x in range(len(self.sources)) if x != g)):
            return None
        return g

    def split_fused_heads(self, node: Node, src: TensorInfo, attr: str | None) -> str:
        """``qkv(x).reshape(B, N, pieces, heads, head_dim)`` of one layer's whole output: the
        pieces become coupled sources with whole heads as units, the output is tracked on the
        head axis, and the module's head-count attribute ``attr`` follows; '' or why not."""
        a, outs = self.maps[src.key].axis, node.outputs[0].shape
        pieces, heads, d = outs[a], outs[a + 1], outs[a + 2]
        where = repr(node.scope) if node.scope else "the top-level module"
        g = self.whole_output(src)
        if g is None:
            return (f"{node.op} in {where} splits into {pieces} pieces of heads a tensor that is not one "
                    "layer's output read only by the reshape")
        first = self.sources[g]
        first.channels = heads * d
        for i in range(1, pieces):
            self.new_source(node.outputs[0], a, replace(first, begin=first.begin + i * heads * d))
            self.union(g, len(self.sources) - 1)
        why = self.coarsen(g, d)
        if why:
            return f"{node.op} in {where} splits the channels into heads of {d}: {why}"
        head_map = ChannelMap.source(g, a + 1, heads)
        self.maps[node.outputs[0].key] = head_map
        if attr is not None:
            self.add_members(head_map, f"{node.scope}.{attr}", ATTRIBUTE, "passive")
        return ""
