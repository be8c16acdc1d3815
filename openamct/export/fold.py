"""Turn a compressed model into plain export modules: every ``CompressedLayer`` becomes an
``ExportLayer`` holding the eval-mode folded weight and bias (BN folded, 2:4 mask applied,
weights fake-quantized) plus whatever the target file wants around the op (explicit fake-quant
ops for the fake-quant model, Q/DQ-exporting ops for the deploy model).

The caller's model is never touched: ``working_copy`` deep-copies it and strips the record
keeper's hooks, so running the copy cannot rewrite the record file.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from openamct._checks import unwrap
from openamct.quant.functions import QMAX, QMIN, to_channel_major
from openamct.quant.layer import CompressedLayer

logger = logging.getLogger(__name__)

__all__ = ["LayerQuant", "ExportLayer", "QDQAct", "WeightQDQ", "working_copy", "compressed_layers",
           "is_quantized", "layer_quant", "fold_layers"]


@dataclass(frozen=True)
class LayerQuant:
    """What the export needs to know of a layer's quantizers, as plain numbers."""

    act: tuple[float, int] | None  # input quantizer (scale, int8 offset)
    out: tuple[float, float] | None  # output observer (min, max), None when never trained


def working_copy(model: nn.Module) -> nn.Module:
    """Deep copy in eval mode without the record keeper (its hooks write the record file)."""
    src = unwrap(model)
    work = copy.deepcopy(src)
    keeper = getattr(work, "_openamct", None)
    if keeper is not None:
        for hooks in (work._forward_pre_hooks, work._forward_hooks):
            for key in [k for k, h in hooks.items() if getattr(h, "__self__", None) is keeper]:
                del hooks[key]
        del work._openamct
    return work.eval()


def compressed_layers(model: nn.Module) -> dict[str, CompressedLayer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, CompressedLayer)}


def is_quantized(layer: CompressedLayer) -> bool:
    return layer.act_quant is not None or layer.wts_quant is not None


@torch.no_grad()
def layer_quant(layer: CompressedLayer) -> LayerQuant:
    act = layer.act_quant.scale_offset() if layer.act_quant is not None else None
    obs = layer.out_observer
    out = (float(obs.min_val), float(obs.max_val)) if obs is not None and bool(obs.initialized) else None
    return LayerQuant(act, out)


class ExportLayer(nn.Module):
    """One folded Conv/ConvTranspose/Linear: ``op(pre(x), weight_fn(weight), bias)``.

    ``pre`` is the input activation module (or None); ``weight_fn`` maps the stored float weight
    to what the op reads (identity, or a Q/DQ-exporting fake quant in the deploy model).
    """

    _openamct_leaf = True  # captured as one node by openamct.graph.capture

    def __init__(self, layer: CompressedLayer, weight: Tensor, bias: Tensor | None,
                 pre: nn.Module | None = None, weight_fn: Callable[[Tensor], Tensor] | None = None,
                 gemm_2d: bool = False) -> None:
        super().__init__()
        self.kind, self.spatial = layer.kind, layer.spatial
        if layer.kind != "linear":
            for k in ("stride", "padding", "dilation", "groups", "padding_mode", "output_padding"):
                setattr(self, k, getattr(layer, k))
            self.pad = list(layer._reversed_padding_repeated_twice)
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.pre, self.weight_fn = pre, weight_fn
        self.gemm_2d = gemm_2d and layer.kind == "linear"

    def forward(self, x: Tensor) -> Tensor:
        if self.gemm_2d and x.dim() != 2:
            # [.., K] -> [N', K] before the input Q/DQ, so the deploy model gets DQ -> Gemm -> Q
            # (QGemm, int32 bias inside) instead of MatMul + float bias Add.
            # Constant widths: a Shape of the output would force ORT to dequantize it.
            y = self._forward(x.reshape(-1, self.weight.shape[1]))
            return y.reshape(*x.shape[:-1], self.weight.shape[0])
        return self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        if self.pre is not None:
            x = self.pre(x)
        w = self.weight if self.weight_fn is None else self.weight_fn(self.weight)
        return self._op(x, w, self.bias)

    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if self.kind == "linear":
            return F.linear(x, w, b)
        if self.kind.startswith("conv_transpose"):
            fn = F.conv_transpose1d if self.kind == "conv_transpose1d" else F.conv_transpose2d
            return fn(x, w, b, self.stride, self.padding, self.output_padding, self.groups, self.dilation)
        fn = (F.conv1d, F.conv2d, F.conv3d)[self.spatial - 1]
        if self.padding_mode != "zeros":
            x = F.pad(x, self.pad, mode=self.padding_mode)
            return fn(x, w, b, self.stride, 0, self.dilation, self.groups)
        return fn(x, w, b, self.stride, self.padding, self.dilation, self.groups)


class QDQAct(nn.Module):
    """uint8 activation quantization (zero point = int8 offset + 128, numerically the same
    as the int8 fake quant); exports as QuantizeLinear -> DequantizeLinear."""

    def __init__(self, scale: float, offset: int) -> None:
        super().__init__()
        self.scale = float(torch.tensor(scale, dtype=torch.float32))
        self.zero_point = int(offset) - QMIN

    def forward(self, x: Tensor) -> Tensor:
        return torch.fake_quantize_per_tensor_affine(x, self.scale, self.zero_point, 0, 255)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.8g}, zero_point={self.zero_point} (uint8)"


class WeightQDQ(nn.Module):
    """Symmetric int8 weight quantization with the trained scales (``axis`` None: per tensor);
    exports as Q/DQ on the weight initializer, which the deploy post-pass stores as int8."""

    def __init__(self, scales: Tensor, axis: int | None) -> None:
        super().__init__()
        self.axis = axis
        self.register_buffer("scales", scales.detach().float().reshape(-1).clone())
        self.register_buffer("zeros", torch.zeros(self.scales.numel(), dtype=torch.int32))
        self.scale = float(self.scales[0])  # per tensor: a constant, not a data-dependent .item()

    def forward(self, w: Tensor) -> Tensor:
        if self.axis is None:
            return torch.fake_quantize_per_tensor_affine(w, self.scale, 0, QMIN, QMAX)
        return torch.fake_quantize_per_channel_affine(w, self.scales, self.zeros, self.axis, QMIN, QMAX)


def per_channel_view(w: Tensor, layer: CompressedLayer) -> tuple[Tensor, int]:
    """The weight with Cout on one axis (regrouped for grouped ConvTranspose) and that axis."""
    return to_channel_major(w, int(layer.weight_axis), int(layer.weight_groups))


Builder = Callable[[str, CompressedLayer, Tensor, Tensor | None], nn.Module]


@torch.no_grad()
def fold_layers(model: nn.Module, build: Builder) -> dict[str, LayerQuant]:
    """Replace every CompressedLayer of ``model`` (a working copy) in place by
    ``build(name, layer, weight, bias)``; return each layer's INT8 parameters."""
    found = compressed_layers(model)
    if "" in found:
        raise ValueError("model: the root module itself is a compressed layer; wrap it in a container")
    quants = {}
    for name, layer in found.items():
        layer.eval()
        w, b = layer.effective_weight_bias()
        quants[name] = layer_quant(layer)
        new = build(name, layer, w.detach().float(), None if b is None else b.detach().float())
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return quants
