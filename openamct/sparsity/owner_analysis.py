"""Per-channel parameter owners in channel-dependency analysis: a module holding one value per
channel of the tracked axis (a norm, GRN, a LayerScale module) and a bare per-channel
parameter in an element-wise op (``gamma * x``) follow the group; ``channel_params`` decides
what counts and slices them.

A norm module whose own forward calls the functional norm (timm's ``BatchNormAct2d`` and
``GroupNormAct``: a BatchNorm2d / GroupNorm subclass that runs ``F.batch_norm`` /
``F.group_norm`` and then an activation child) is not one graph node: the capture records the
functional call, with the module's parameters and buffers as its tensor arguments. That call
follows the group as the module itself would, when every one of those tensors belongs to that
one norm module and nothing else reads them.
"""

from __future__ import annotations

from torch import nn

from openamct.graph.node import Node, TensorInfo
from openamct.layer_types import BATCHNORM_TYPES
from openamct.sparsity.channel_params import Owner, owner_of, parameter_owner

# functional norms -> the module types whose forward may call them with their own parameters
NORM_FUNCTIONS = {"batch_norm": BATCHNORM_TYPES, "group_norm": (nn.GroupNorm,), "layer_norm": (nn.LayerNorm,)}


class OwnersMixin:
    """Methods of ``dependency._Analysis`` (state: maps, folds, modules, graph)."""

    def owner(self, node: Node, ins: list[TensorInfo]) -> None:
        """A module that may hold per-channel vectors of the tracked axis: it follows (its
        vectors are sliced, GroupNorm adds its group count to the equal-removal blocks)."""
        if len(ins) > 1 or node.inputs[0] is not ins[0]:
            found: Owner | str = f"module {node.name!r} ({node.op}) reads the channels of a second tensor"
        elif len(self.graph.module_calls.get(node.name, [])) != 1:
            found = f"module {node.name!r} ({node.op}) is called more than once"
        else:
            found = owner_of(node.name, self.modules[node.name], ins[0].shape,
                             [o.shape for o in node.outputs], self.maps[ins[0].key].axis)
        self.join_owner(node, ins, node.name, found)

    def join_owner(self, node: Node, ins: list[TensorInfo], name: str, found: Owner | str) -> None:
        """Owner ``name`` (a module, found by ``owner_of``) follows the channels ``node`` reads
        and passes them on, or blocks them with the reason ``found`` gives."""
        cmap = self.maps[ins[0].key]
        if isinstance(found, str):
            self.block(ins, node.name, found)
            return
        if found.fold > 1:
            if any(offset or seg.size % found.fold or seg.repeat > 1 for seg, offset in cmap.placed()) \
                    or len(cmap.segments) != 1:
                self.block(ins, node.name, f"GroupNorm {name!r} (groups={found.fold}) reads channels of "
                                           "several layers or a flattened axis")
                return
            self.folds[cmap.segments[0].gid].append(found.fold)
        if found.op_type:  # (SCALARS: nothing to slice)
            self.add_members(cmap, name, found.op_type, "passive")
        self.passthrough(node, ins[0], cmap)

    def norm_function(self, node: Node, ins: list[TensorInfo]) -> None:
        """``F.batch_norm`` / ``F.group_norm`` / ``F.layer_norm`` called by a norm module's own
        forward with that module's parameters: the module follows as if it were called."""
        found = self.norm_owner(node, ins)
        if isinstance(found, str):
            self.block(ins, node.name, found)
            return
        name, module = found
        cmap = self.maps[ins[0].key]
        if not isinstance(module, BATCHNORM_TYPES):
            self.join_owner(node, ins, name, owner_of(name, module, ins[0].shape, [o.shape for o in node.outputs],
                                                      cmap.axis))
        elif cmap.axis != 1 or module.num_features != ins[0].shape[1]:
            self.block(ins, node.name, f"{node.op} of {name!r} normalises another axis than the channels")
        else:
            self.add_members(cmap, name, "BatchNormalization", "passive")
            self.passthrough(node, ins[0], cmap)

    def norm_owner(self, node: Node, ins: list[TensorInfo]) -> tuple[str, nn.Module] | str:
        """(path, module) of the norm module whose parameters the functional norm ``node``
        reads, or why it has none the analysis can slice."""
        if ins != [node.inputs[0]]:
            return f"{node.op} reads the channels of a second tensor argument"
        rest = node.inputs[1:]
        if not rest:
            return f"{node.op} has no weight, bias or statistics of a norm module to slice with the channels"
        names = {t.param_name.rpartition(".")[0] if t.param_name else None for t in rest}
        name = names.pop() if len(names) == 1 else None
        module = self.modules.get(name) if name is not None else None
        if module is None or not isinstance(module, NORM_FUNCTIONS[node.op]):
            what = ", ".join(sorted(t.param_name or "a computed tensor" for t in rest))
            return f"{node.op} reads {what}, not the parameters of one norm module"
        attrs = {t.param_name.rpartition(".")[2] for t in rest}
        if any(len(t.consumers) != 1 or t.producer is not None for t in rest) or len(attrs) != len(rest):
            return f"the parameters of {name!r} are read by more than this {node.op} (called more than once?)"
        return name, module

    def per_channel_param(self, node: Node, t: TensorInfo, ndim: int, axis: int, channels: int) -> TensorInfo | None:
        """The model parameter with one value per channel (LayerScale) that element-wise op
        ``node`` reads as ``t``: ``t`` itself, or the ``(C,)`` parameter ``t`` is a chain of views,
        reshapes or unsqueezes of, each read once (timm's ConvNeXt: ``x.mul(gamma.reshape(1, -1,
        1, 1))``; Hugging Face PoolFormer: ``scale.unsqueeze(-1).unsqueeze(-1) * x``); None if
        neither. Each step only adds size-1 dims around the channels, so slicing the parameter
        slices what the op reads."""
        if node.op not in ("mul", "add", "sub", "div") or not parameter_owner(t.shape, ndim, axis, channels):
            return None
        if t.producer is None:
            return t if t.param_name is not None else None
        src = t
        while src.producer is not None:
            p = src.producer
            if (p.kind != "function" or len(p.inputs) != 1 or p.op not in ("view", "reshape", "unsqueeze")
                    or len(src.consumers) != 1):
                return None
            src = p.inputs[0]
        if src.param_name is None or src.shape != (channels,):
            return None
        return src
