"""Module calls in the channel-dependency analysis: a Conv/Linear layer starts a channel space
(a ``Source``) and consumes the channels it reads; BatchNorms and depthwise convs follow their
input's channels passively; one-input activations pass them on; per-channel parameter owners
(``owner_analysis``) and per-head bias tables (``head_bias``) join; anything else blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openamct.graph.layers import LayerInfo
from openamct.graph.node import Node, TensorInfo
from openamct.layer_types import FILTER_TYPES, features
from openamct.sparsity.channel_ops import BATCHNORMS, CONSUMER_TYPES, PRODUCER_OP, UNARY_MODULES
from openamct.sparsity.head_bias import EMBEDDING, head_embedding

__all__ = ["ModulesMixin", "Source"]


@dataclass
class Source:
    """A channel space's origin: the layer (or per-head table) whose output channels start it."""

    name: str
    op_type: str
    channels: int
    group: int
    spec: Any  # techniques.filter_prune.FilterSpec; None: the layer starts a channel space but is not pruned
    why_not: str = ""
    begin: int = 0  # first output row: a piece of a fused projection's output (fused_split)
    follower: bool = False  # not a layer: a per-head bias table that follows its head group (head_bias)


class ModulesMixin:
    """Methods of ``dependency._Analysis`` (state: layers, plan, modules, maps, members, folds, graph)."""

    def module(self, node: Node) -> None:
        info, ins = self.layers.get(node.name), self.tracked(node)
        if info is not None:
            self.layer(node, info, ins)
        elif not ins:
            heads = head_embedding(node, self.modules, len(self.graph.module_calls.get(node.name, [])))
            if heads is not None:  # T5's relative_attention_bias: one column per head
                out = node.outputs[0]
                self.new_source(out, len(out.shape) - 1, Source(node.name, EMBEDDING, heads, 1, None,
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
        elif node.op in ("Softmax", "LogSoftmax") and len(ins) == 1 and node.inputs[0] is ins[0]:
            # SqueezeBERT's nn.Softmax(dim=-1) over attention scores tracked on the head axis
            dim = getattr(self.modules.get(node.name), "dim", None)
            cmap = self.maps[ins[0].key]
            if type(dim) is int and dim % len(ins[0].shape) != cmap.axis:
                self.passthrough(node, ins[0], cmap)
            else:
                self.block(ins, node.name, f"{node.op} {node.name!r} works along the channel axis")
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
        self.new_source(out, axis, Source(node.name, PRODUCER_OP[info.type], channels, group, spec, why))

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
