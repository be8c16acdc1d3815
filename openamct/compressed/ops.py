"""The conv / transposed conv / linear call of a weight layer, shared by the training-time
compressed layer and the export-time folded layer, so both compute exactly the same op."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from openamct.layer_types import layer_type_of

CONV_ATTRS = ("stride", "padding", "dilation", "groups", "padding_mode", "output_padding")

def as_layer_class(wrapper: type, layer_cls: type) -> type:
    """A subclass of ``wrapper`` that is also ``layer_cls``: code around a compressed layer
    (``isinstance(m, nn.Conv2d)``, Hugging Face's ``isinstance(m, Conv1D)``) sees what it
    saw before. The wrapper comes first, so its ``__init__``, ``forward`` and repr win.

    A new class per call, registered nowhere: its instances pickle and deep-copy through
    ``__reduce_ex__``, which names the wrapper and the layer class (both importable), not the
    generated class."""
    if issubclass(layer_cls, wrapper):
        layer_cls = layer_cls._layer_cls
    name = f"{wrapper.__name__}_{layer_cls.__name__}"
    return type(name, (wrapper, layer_cls), {"__module__": __name__, "__qualname__": name,
                                            "_layer_cls": layer_cls, "_wrapper_cls": wrapper,
                                            "__reduce_ex__": _reduce_generated})


def _new_generated(wrapper: type, layer_cls: type):
    """An empty instance of ``as_layer_class(wrapper, layer_cls)`` (pickle and copy then set its
    state)."""
    cls = as_layer_class(wrapper, layer_cls)
    return cls.__new__(cls)


def _reduce_generated(self, protocol):
    return _new_generated, (type(self)._wrapper_cls, type(self)._layer_cls), self.__getstate__()


def public_attrs(module: nn.Module) -> dict:
    """The plain attributes third-party forward code may read (kernel_size, nf, num_heads...)."""
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and not isinstance(v, (Tensor, nn.Module))}


def op_kind(module: nn.Module) -> tuple[str, int]:
    """("linear" | "conv{d}d" | "conv_transpose{d}d", spatial dims) of a supported layer."""
    row = layer_type_of(module)
    if row is None:
        from openamct.layer_types import ALL_TYPES

        raise TypeError(f"module: expected one of {list(ALL_TYPES)}, got {type(module).__name__}")
    if row.matrix:  # "linear_t": Hugging Face Conv1D, y = x @ W + b with W [in, out]
        return ("linear_t" if row.transposed else "linear"), 0
    return f"{'conv_transpose' if row.transposed else 'conv'}{row.spatial}d", row.spatial


class WeightOp(nn.Module):
    """Base of modules that run ``op(x, w, b)`` with a layer's hyper-parameters.

    Subclasses set ``kind``, ``spatial`` and, for convs, the ``CONV_ATTRS`` and
    ``_reversed_padding_repeated_twice`` (copied with ``copy_op_attrs``)."""

    kind: str
    spatial: int

    def copy_op_attrs(self, src: nn.Module) -> None:
        if not self.kind.startswith("linear"):
            for k in CONV_ATTRS:
                setattr(self, k, getattr(src, k))
            self._reversed_padding_repeated_twice = list(src._reversed_padding_repeated_twice)

    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        k = self.kind
        if k == "linear":
            return F.linear(x, w, b)
        if k == "linear_t":
            return F.linear(x, w.t(), b)
        if k.startswith("conv_transpose"):
            fn = F.conv_transpose1d if k == "conv_transpose1d" else F.conv_transpose2d
            return fn(x, w, b, self.stride, self.padding, self.output_padding, self.groups,
                      self.dilation)
        fn = (F.conv1d, F.conv2d, F.conv3d)[self.spatial - 1]
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return fn(x, w, b, self.stride, 0, self.dilation, self.groups)
        return fn(x, w, b, self.stride, self.padding, self.dilation, self.groups)
