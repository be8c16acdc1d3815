"""Attention heads in channel-dependency analysis: a group's unit can grow from one channel to
a whole head (``head_dim`` consecutive channels) or a whole grouped-query group of heads.

Why a unit and not a new kind of map: a ``view(..., -1, head_dim)`` splits the channel axis
into (heads, head_dim). Once every channel of the group is ``head_dim`` consecutive positions
(``coarsen``), the head axis is an ordinary tracked axis whose segments have ``repeat / head_dim``;
Q·Kᵀ and softmax·V couple Q, K and V on that (batch) axis like an element-wise op, and the
merge ``reshape(..., -1)`` is a plain flatten (repeat × head_dim) into O's input. Removing whole
units of channels is always safe, so coarsening never changes what is correct, only how fine
the removal is. GQA: K/V reach Q·Kᵀ expanded (``repeat_kv``) as repeat = n_rep heads; Q is
coarsened to n_rep heads per unit, so a KV head and its n_rep query heads go together and the
model's ``num_key_value_groups`` stays right.

Where the view writes the head count out (``view(b, -1, self.num_heads, d)``) the module's
``num_heads``-like attribute equal to it follows the kept heads (an ``Attribute`` record node);
without such an attribute the group is refused, naming the module.
"""

from __future__ import annotations

import math
from dataclasses import replace

from openamct.graph.node import Node, TensorInfo
from openamct.sparsity.channel_params import ATTRIBUTE, SIZE_ATTRS
from openamct.sparsity.index_mapping import ChannelMap, Segment, align

MATMULS = ("matmul", "bmm")
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")


class HeadsMixin:
    """Methods of ``dependency._Analysis`` (state: sources, members, folds, maps, unit)."""

    def coarsen(self, gid: int, factor: int) -> str:
        """Make one unit of ``gid``'s coupled class ``factor`` of its current units; '' or why not."""
        root = self.find(gid)
        cls = {g for g in range(len(self.sources)) if self.find(g) == root}
        for g in cls:
            if self.sources[g].channels % factor:
                return f"{self.sources[g].channels} channels do not split into units of {factor}"
            # a grouped conv (SqueezeBERT's Q/K/V) removes as many units from each of its blocks:
            # a block must then hold whole heads
            blocks = math.lcm(1, *self.folds[g])
            if (self.sources[g].channels // factor) % blocks:
                return (f"{self.sources[g].channels} channels in {blocks} grouped-conv blocks do not split "
                        f"into whole units of {factor} per block")
        for g in cls:
            self.sources[g].channels //= factor
            self.unit[g] *= factor
            self.members[g] = [(o, replace(m, repeat=m.repeat * factor)) for o, m in self.members[g]]
        for key, cmap in self.maps.items():
            if any(s.gid in cls for s in cmap.segments):
                self.maps[key] = replace(cmap, segments=tuple(
                    replace(s, length=s.length // factor, repeat=s.repeat * factor) if s.gid in cls else s
                    for s in cmap.segments))
        return ""

    def split_heads(self, node: Node, src: TensorInfo) -> str:
        """A view/reshape of the channel axis C into (C / d, d): follow it on the first part
        with whole units of d channels; '' or why not."""
        cmap, ins, outs = self.maps[src.key], src.shape, node.outputs[0].shape
        a = cmap.axis
        if (len(outs) == len(ins) + 2 and outs[:a] == ins[:a] and outs[a + 3:] == ins[a + 1:]
                and outs[a] * outs[a + 1] * outs[a + 2] == ins[a] and node.op in ("view", "reshape")):
            return self.fused_heads(node, src)
        if not (len(outs) == len(ins) + 1 and outs[:a] == ins[:a] and outs[a + 2:] == ins[a + 1:]
                and outs[a] * outs[a + 1] == ins[a]):
            return f"{node.op} splits the channel dim or merges it with a dim before it"
        d = outs[a + 1]
        vals = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        attr = None
        if node.op not in ("view", "reshape") or len(vals) != len(outs) or vals[a] != -1:
            # the head count comes from the module (view(b, -1, self.num_heads, d)): that attribute
            # must follow the pruned heads; without one we cannot know what the forward reads
            owner = self.modules.get(node.scope)
            attr = next((n for n in HEAD_ATTRS if owner is not None and type(getattr(owner, n, None)) is int
                         and getattr(owner, n) == outs[a]), None)
            if attr is None or len(vals) != len(outs) or vals[a] != outs[a]:
                where = repr(node.scope) if node.scope else "the top-level module"
                return (f"{node.op} in {where} splits the channels into {outs[a]} heads of {d} with the "
                        f"head count written out, and {where} has no attribute "
                        f"{'/'.join(HEAD_ATTRS)} = {outs[a]} to update: pruned heads cannot be followed")
        for seg, offset in cmap.placed():
            if offset % d:
                return f"{node.op} splits the channel axis across layers' channels"
            if seg.repeat % d:
                why = self.coarsen(seg.gid, d // math.gcd(seg.repeat, d))
                if why:
                    return f"{node.op} splits the channels into heads of {d}: {why}"
        cmap = self.maps[src.key]
        if any(s.size % d for s in cmap.segments):
            return f"{node.op} splits the channel axis across layers' channels"
        segs = tuple(replace(s, repeat=s.repeat // d) if s.gid is not None else Segment(None, 0, s.size // d)
                     for s in cmap.segments)
        for out in node.outputs:
            self.maps[out.key] = ChannelMap(a, segs)
        if attr is not None:
            self.add_members(ChannelMap(a, segs), f"{node.scope}.{attr}", ATTRIBUTE, "passive")
        return ""

    def fused_heads(self, node: Node, src: TensorInfo) -> str:
        """``reshape(B, N, 3, self.num_heads, head_dim)`` (timm's ``Attention``): the head count
        must be -1 or a head-count attribute of the module, which then follows; '' or why not."""
        a, outs = self.maps[src.key].axis, node.outputs[0].shape
        vals = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        owner = self.modules.get(node.scope)
        attr = next((n for n in HEAD_ATTRS if owner is not None and type(getattr(owner, n, None)) is int
                     and getattr(owner, n) == outs[a + 1]), None)
        if len(vals) != len(outs) or vals[a] != outs[a] or vals[a + 2] != outs[a + 2] \
                or not (vals[a + 1] == -1 or vals[a + 1] == outs[a + 1] and attr is not None):
            where = repr(node.scope) if node.scope else "the top-level module"
            return (f"{node.op} in {where} splits the channels into {outs[a]} pieces of {outs[a + 1]} heads of "
                    f"{outs[a + 2]} with the head count written out, and {where} has no attribute "
                    f"{'/'.join(HEAD_ATTRS)} = {outs[a + 1]} to update: pruned heads cannot be followed")
        return self.split_fused_heads(node, src, attr if vals[a + 1] != -1 else None)

    def attention(self, node: Node, ins: list[TensorInfo]) -> None:
        """``scaled_dot_product_attention(q, k, v)``: heads tracked on a batch dim of Q, K and V
        couple them as Q·Kᵀ and softmax·V do; the output carries V's heads."""
        qkv = node.inputs[:3]
        if any(self.maps[t.key].axis >= len(t.shape) - 2 for t in ins) or any(t.key not in self.maps for t in qkv):
            self.block(ins, node.name, f"{node.op} uses the channels as a matrix dimension, or reads heads "
                                       "only some of Q, K and V carry")
            return
        rep = 1
        if node.kwargs.get("enable_gqa") is True:
            rep = self.gqa_heads(qkv)
            if isinstance(rep, str):
                self.block(ins, node.name, f"{node.op} with enable_gqa: {rep}")
                return
        self.reconcile([t.key for t in qkv])
        out_map = self.couple(node, list(qkv), len(node.outputs[0].shape))
        for t in {t.key: t for t in qkv[1:]}.values() if rep > 1 else ():  # K and V keep their own layout for any other reader
            cmap = self.maps[t.key]
            self.maps[t.key] = replace(cmap, segments=tuple(replace(x, repeat=x.repeat // rep) for x in cmap.segments))
        if out_map is not None:
            self.maps[node.outputs[0].key] = out_map

    def gqa_heads(self, qkv: list[TensorInfo]) -> int | str:
        """``enable_gqa=True`` (Hugging Face's SDPA path for Llama, Qwen2, Mistral with no mask):
        query head i reads KV head i // n_rep, which is ``repeat_interleave`` of K and V's heads,
        so K and V are followed as if expanded n_rep times (the eager path's ``repeat_kv``), and
        ``reconcile`` then makes a KV head and its n_rep query heads one unit. n_rep, or why not."""
        q, k, v = qkv
        a = self.maps[q.key].axis
        if self.maps[k.key].axis != a or self.maps[v.key].axis != a:
            return "Q, K and V carry their heads on different axes"
        hq, hk = q.shape[a], k.shape[a]
        if hk == hq:
            return 1
        if hk == 0 or hq % hk or v.shape[a] != hk:
            return f"{hq} query heads do not split into groups over {hk} key/value heads"
        for t in {k.key: k, v.key: v}.values():
            self.maps[t.key] = self.maps[t.key].expanded(hq // hk)
        return hq // hk

    def size_attribute(self, node: Node, axis: int, cmap: ChannelMap) -> str:
        """A merge reshape that writes the merged size out (MobileViT's ``view(..., self.all_head_size)``)
        reads it from somewhere: a size attribute of the module follows the kept count; with
        none, the size may be a constant that would not follow (``view(-1, 16*5*5)`` before a
        Linear, ``reshape(b, n, d)`` with the residual width): refused when it lands on the last
        axis, where Linear consumers read. A merge onto an inner axis (Llama's ``repeat_kv``
        reshape, sized from the tensor's own shape) is followed. '' or why."""
        vals = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        out = node.outputs[0].shape
        if node.op not in ("view", "reshape") or len(vals) != len(out) or vals[axis] != out[axis]:
            return ""
        owner = self.modules.get(node.scope)
        for attr in SIZE_ATTRS:  # (SqueezeBERT merges onto the inner axis with all_head_size)
            if owner is not None and type(getattr(owner, attr, None)) is int and getattr(owner, attr) == out[axis]:
                self.add_members(cmap, f"{node.scope}.{attr}", ATTRIBUTE, "passive")
                return ""
        if axis != len(out) - 1:
            return ""
        # GPT-Neo's merge: view(..., self.num_heads * self.head_dim), computed from the head-count
        # attribute its split already made follow. A literal width that happens to be equal
        # passes here, and then fails consistency's pruned forward, which keeps the group whole.
        heads = {f"{node.scope}.{h}" for h in HEAD_ATTRS}
        if any(m.op_type == ATTRIBUTE and m.name in heads
               for g in cmap.gids() for x in range(len(self.sources)) if self.find(x) == self.find(g)
               for _, m in self.members[x]):
            return ""
        return (f"{node.op} writes the merged channel size {out[axis]} out, not -1, and its module has no "
                f"{'/'.join(SIZE_ATTRS)} = {out[axis]} to update: the size would not follow pruning")

    def reconcile(self, keys: list[int]) -> None:
        """Coarsen single-segment maps that cover the same positions in different units (a GQA
        K expanded n_rep times against Q's heads) until they line up."""
        maps = [self.maps[k] for k in keys]
        ref = maps[0]
        for m in maps[1:]:
            if align(ref, m) is not None or len(ref.segments) != 1 or len(m.segments) != 1:
                continue
            x, y = ref.segments[0], m.segments[0]
            if x.size != y.size or x.gid is None or y.gid is None:
                continue
            fine, coarse = (x, y) if x.repeat < y.repeat else (y, x)
            if coarse.repeat % fine.repeat == 0 and not self.coarsen(fine.gid, coarse.repeat // fine.repeat):
                ref = self.maps[keys[0]]

    def matmul(self, node: Node, ins: list[TensorInfo]) -> None:
        """Q·Kᵀ / softmax·V: channels tracked on a batch dim of both sides couple like an
        element-wise op; a tracked matrix dim cannot be followed."""
        if len(node.inputs) != 2 or any(self.maps[t.key].axis >= len(t.shape) - 2 for t in ins):
            self.block(ins, node.name, f"{node.op} uses the channels as a matrix dimension")
            return
        ndim = len(node.outputs[0].shape)
        self.reconcile([t.key for t in ins])
        out_map = self.couple(node, list(node.inputs), ndim)
        if out_map is not None:
            self.maps[node.outputs[0].key] = out_map
