"""Per-channel parameter owners in channel-dependency analysis: a module holding one value per
channel of the tracked axis (a norm, GRN, a LayerScale module) and a bare per-channel
parameter in an element-wise op (``gamma * x``) follow the group; ``channel_params`` decides
what counts and slices them."""

from __future__ import annotations

from openamct.graph.node import Node, TensorInfo
from openamct.prune.channel_params import Owner, owner_of, parameter_owner


class OwnersMixin:
    """Methods of ``dependency._Analysis`` (state: maps, folds, modules, graph)."""

    def owner(self, node: Node, ins: list[TensorInfo]) -> None:
        """A module that may hold per-channel vectors of the tracked axis: it follows (its
        vectors are sliced, GroupNorm adds its group count to the equal-removal blocks)."""
        cmap = self.maps[ins[0].key]
        if len(ins) > 1 or node.inputs[0] is not ins[0]:
            found: Owner | str = f"module {node.name!r} ({node.op}) reads the channels of a second tensor"
        elif len(self.graph.module_calls.get(node.name, [])) != 1:
            found = f"module {node.name!r} ({node.op}) is called more than once"
        else:
            found = owner_of(node.name, self.modules[node.name], ins[0].shape,
                             [o.shape for o in node.outputs], cmap.axis)
        if isinstance(found, str):
            self.block(ins, node.name, found)
            return
        if found.fold > 1:
            if any(offset or seg.size % found.fold or seg.repeat > 1 for seg, offset in cmap.placed()) \
                    or len(cmap.segments) != 1:
                self.block(ins, node.name, f"GroupNorm {node.name!r} (groups={found.fold}) reads channels of "
                                           "several layers or a flattened axis")
                return
            self.folds[cmap.segments[0].gid].append(found.fold)
        self.add_members(cmap, node.name, found.op_type, "passive")
        self.passthrough(node, ins[0], cmap)

    def per_channel_param(self, node: Node, t: TensorInfo, ndim: int, axis: int, channels: int) -> bool:
        """A model parameter with one value per channel (LayerScale), read by an element-wise op."""
        return (t.producer is None and t.param_name is not None and node.op in ("mul", "add", "sub", "div")
                and parameter_owner(t.shape, ndim, axis, channels))
