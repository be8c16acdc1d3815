"""The conv / transposed conv / linear call of a weight layer, shared by the training-time
compressed layer and the export-time folded layer, so both compute exactly the same op."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from openamct.layer_types import layer_type_of

CONV_ATTRS = ("stride", "padding", "dilation", "groups", "padding_mode", "output_padding")


def op_kind(module: nn.Module) -> tuple[str, int]:
    """("linear" | "conv{d}d" | "conv_transpose{d}d", spatial dims) of a supported layer."""
    row = layer_type_of(module)
    if row is None:
        from openamct.layer_types import ALL_TYPES

        raise TypeError(f"module: expected one of {list(ALL_TYPES)}, got {type(module).__name__}")
    if row.spatial == 0:
        return "linear", 0
    return f"{'conv_transpose' if row.transposed else 'conv'}{row.spatial}d", row.spatial


class WeightOp(nn.Module):
    """Base of modules that run ``op(x, w, b)`` with a layer's hyper-parameters.

    Subclasses set ``kind``, ``spatial`` and, for convs, the ``CONV_ATTRS`` and
    ``_reversed_padding_repeated_twice`` (copied with ``copy_op_attrs``)."""

    kind: str
    spatial: int

    def copy_op_attrs(self, src: nn.Module) -> None:
        if self.kind != "linear":
            for k in CONV_ATTRS:
                setattr(self, k, getattr(src, k))
            self._reversed_padding_repeated_twice = list(src._reversed_padding_repeated_twice)

    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        k = self.kind
        if k == "linear":
            return F.linear(x, w, b)
        if k.startswith("conv_transpose"):
            fn = F.conv_transpose1d if k == "conv_transpose1d" else F.conv_transpose2d
            return fn(x, w, b, self.stride, self.padding, self.output_padding, self.groups,
                      self.dilation)
        fn = (F.conv1d, F.conv2d, F.conv3d)[self.spatial - 1]
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return fn(x, w, b, self.stride, 0, self.dilation, self.groups)
        return fn(x, w, b, self.stride, self.padding, self.dilation, self.groups)
