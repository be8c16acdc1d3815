"""Lower a compressed model to plain export modules: every ``CompressedLayer`` becomes an
``ExportLayer`` holding the eval-mode folded weight and bias (BN folded, masks applied,
weights fake-quantized) plus whatever the target file wants around the op (explicit fake-quant
ops for the fake-quant model, Q/DQ-exporting ops for the deploy model). What each layer's
techniques contribute comes from their ``export_parts`` verb, as one ``ExportParts``.

The caller's model is never touched: ``working_copy`` deep-copies it and strips the record
keeper's hooks, so running the copy cannot rewrite the record file.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from openamct._checks import unwrap
from openamct.compressed.layer import CompressedLayer
from openamct.compressed.ops import WeightOp, as_layer_class, public_attrs
from openamct.module_tree import set_module
from openamct.quant.activation import QuantizedActivation
from openamct.quant.functions import QMAX, QMIN, to_channel_major
from openamct.quant.residual import swap_hook_quantizers
from openamct.techniques.base import ExportParts, Technique

logger = logging.getLogger(__name__)

__all__ = ["ExportLayer", "QDQAct", "WeightQDQ", "working_copy", "compressed_layers",
           "export_parts", "fold_layers", "fold_activations"]


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


def export_parts(layer: CompressedLayer, techniques: Sequence[Technique]) -> ExportParts:
    parts = ExportParts()
    for technique in techniques:
        technique.export_parts(layer, parts)
    return parts


class ExportLayer(WeightOp):
    """One folded Conv/ConvTranspose/Linear: ``op(pre(x), weight_fn(weight), bias)``.

    ``pre`` is the input activation module (or None); ``weight_fn`` maps the stored float weight
    to what the op reads (identity, or a Q/DQ-exporting fake quant in the deploy model); ``post``
    the output quantizer's export form (or None).
    """

    _openamct_leaf = True  # captured as one node by openamct.graph.capture

    def __init__(self, layer: CompressedLayer, weight: Tensor, bias: Tensor | None,
                 pre: nn.Module | None = None, weight_fn: Callable[[Tensor], Tensor] | None = None,
                 gemm_2d: bool = False, post: nn.Module | None = None) -> None:
        nn.Module.__init__(self)  # not the layer class's: see compressed.ops.as_layer_class
        for k, v in public_attrs(layer).items():  # e.g. kernel_size for HF's TF-style padding
            setattr(self, k, v)
        # A Conv1D (W [in, out]) goes out as a Linear: ``weight`` arrives transposed (fold_layers).
        self.kind, self.spatial = ("linear" if layer.kind == "linear_t" else layer.kind), layer.spatial
        self.copy_op_attrs(layer)
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.pre, self.weight_fn, self.post = pre, weight_fn, post
        self.gemm_2d = gemm_2d and self.kind == "linear"

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
        y = self._op(x, w, self.bias)
        return y if self.post is None else self.post(y)


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
    if layer.kind == "linear_t":  # already transposed to [out, in] for export
        return w, 0
    """The weight with Cout on one axis (regrouped for grouped ConvTranspose) and that axis."""
    return to_channel_major(w, int(layer.weight_axis), int(layer.weight_groups))


# What a target file puts around one layer's op: ExportLayer keyword arguments (pre, weight_fn...).
Builder = Callable[[str, CompressedLayer, Tensor, ExportParts], dict]


@torch.no_grad()
def fold_layers(model: nn.Module, build: Builder, techniques: Sequence[Technique]) -> dict[str, ExportParts]:
    """Replace every CompressedLayer of ``model`` (a working copy) in place by
    an ExportLayer of the same class with ``build(name, layer, weight, parts)``'s extras;
    return each layer's ExportParts."""
    found = compressed_layers(model)
    if "" in found:
        raise ValueError("model: the root module itself is a compressed layer; wrap it in a container")
    out = {}
    for name, layer in found.items():
        layer.eval()
        w, b = layer.effective_weight_bias()
        if layer.kind == "linear_t":
            w = w.t()  # exported as a Linear, so ONNX Runtime runs it as QGemm like any other
        parts = out[name] = export_parts(layer, techniques)
        new = as_layer_class(ExportLayer, type(layer))(layer, w.detach().float(), None if b is None else b.detach().float(),
                                                         **build(name, layer, w, parts))
        set_module(model, name, new)
    return out


def fold_activations(model: nn.Module, make: Callable[[float, int], nn.Module]) -> int:
    """Give every QuantizedActivation and output hook of ``model`` (a working copy) the export
    form of its quantizers, ``make(scale, offset)`` (FakeQuantAct or QDQAct); returns how many."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedActivation)]
    for name, m in found:
        set_module(model, name, m.with_quantizers(make).eval())
    return len(found) + swap_hook_quantizers(model, make)
