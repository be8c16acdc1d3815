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
from torch.autograd import Function

from openamct._checks import unwrap
from openamct.compressed.layer import CompressedLayer
from openamct.compressed.ops import WeightOp, as_layer_class, public_attrs
from openamct.export.element_types import storage_dtype
from openamct.formats import INT8_ACT, INT8_WEIGHT, QuantFormat
from openamct.module_tree import set_module
from openamct.quant.activation import QuantizedActivation
from openamct.quant.functions import to_channel_major
from openamct.quant.matmul import swap_matmul_quantizers
from openamct.quant.residual import swap_hook_quantizers
from openamct.sparsity.nm import NMSparsifier
from openamct.techniques.base import ExportParts, Technique
from openamct.training.decisions import KEY as DECISIONS_KEY

logger = logging.getLogger(__name__)

__all__ = ["ExportLayer", "QDQAct", "WeightDQ", "working_copy", "inputs_on_cpu", "compressed_layers",
           "export_parts", "fold_layers", "fold_activations", "is_placeholder", "zero_twin"]


def working_copy(model: nn.Module, cpu: bool = False) -> nn.Module:
    """Deep copy in eval mode without the record keeper (its hooks write the record file).

    The weights and biases of the layers, and the parameters of the model's own modules
    (embeddings, norms), are shared, not copied: folding reads them and writes new tensors, and
    nothing in the export writes to them, so a save holds no second copy of the model. So are
    computed 2:4 masks (packed bits); openamct's quantizers and uncomputed masks are copied: an
    eval forward may still initialise them.

    ``cpu``: the copy lives on the CPU (the ONNX export traces there). For a model elsewhere (a
    CUDA model) the shared tensors are then CPU copies instead, and the rest is moved after
    the deep copy; the model itself stays on its device.
    """
    src = unwrap(model)
    elsewhere = cpu and any(t.device.type != "cpu" for t in (*src.parameters(), *src.buffers()))
    memo = {id(p): _on_cpu_param(p) if elsewhere else p
            for m in src.modules() if isinstance(m, CompressedLayer) or not _is_ours(m)
            for p in m._parameters.values() if p is not None}
    memo.update((id(m.mask_bits), m.mask_bits.cpu() if elsewhere else m.mask_bits)
                for m in src.modules() if isinstance(m, NMSparsifier) and m._ready)
    work = copy.deepcopy(src, memo)
    if elsewhere:  # every tensor still on the device is the copy's own
        _to_cpu(work)
    keeper = getattr(work, "_openamct", None)
    if keeper is not None:
        for hooks in (work._forward_pre_hooks, work._forward_hooks):
            for key in [k for k, h in hooks.items() if getattr(h, "__self__", None) is keeper]:
                del hooks[key]
        del work._openamct
    work._buffers.pop(DECISIONS_KEY, None)  # the record identity is for restore and save, not the ONNX
    return work.eval()


def _on_cpu_param(p: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(p.detach().cpu(), requires_grad=p.requires_grad)


def _to_cpu(work: nn.Module) -> None:
    """Replace (not ``.to()``: that may rewrite a tensor object in place) every parameter and
    buffer of ``work`` that is not on the CPU by a CPU copy."""
    for m in work.modules():
        for k, p in m._parameters.items():
            if p is not None and p.device.type != "cpu":
                m._parameters[k] = _on_cpu_param(p)
        for k, b in m._buffers.items():
            if b is not None and b.device.type != "cpu":
                m._buffers[k] = b.cpu()


def inputs_on_cpu(input_data):
    """``input_data`` with every tensor (in tuples, lists, dicts) on the CPU, for a CPU copy."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.cpu() if isinstance(t, Tensor) else t, input_data)


def _is_ours(module: nn.Module) -> bool:
    return type(module).__module__.startswith("openamct.")


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
        # An int8 weight (the deploy model's) is stored as ``weight_int8``, the initializer name
        # the deploy file has always used; ``weight_fn`` dequantizes it.
        # Not a tensor: a deferred weight (``fold_layers``' ``defer``), computed when read.
        self._deferred = None if isinstance(weight, Tensor) else weight
        self._wname = "weight" if weight.dtype.is_floating_point else "weight_int8"
        self._path = ""  # the layer's name in the model (fold_layers): its deferred weight's key
        if self._deferred is None:
            self.register_parameter(self._wname, nn.Parameter(weight.detach().clone(), requires_grad=False))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.pre, self.weight_fn, self.post = pre, weight_fn, post
        self.gemm_2d = gemm_2d and self.kind == "linear"

    def __getattr__(self, name: str):
        # ``weight`` stays readable (float, [out, in]) when it is stored as int8 or transposed:
        # model code reads it (HF ViT casts its input to ``projection.weight.dtype``, T5 checks
        # ``wo.weight``). A view of W^T; the dequantized int8 values (computed on access). A
        # deferred weight is computed on access too, under either name.
        d = self.__dict__
        wname, deferred = d.get("_wname", "weight"), d.get("_deferred")
        if deferred is not None and name in ("weight", wname):
            if torch.jit.is_tracing():
                # Model code reads dtype or shape here (ViT, T5). Computed, the weight would
                # enter the trace as a constant built from a parameter (an error, and a copy).
                dtype = torch.float32 if name == "weight" else deferred.dtype
                return torch.zeros((), dtype=dtype).expand(deferred.shape if name == "weight" else deferred.stored_shape)
            value = deferred.compute()
            if name == wname:
                return value
            return value.t() if wname == "weight_t" else value if wname == "weight" else self.weight_fn(value)
        if name == "weight" and wname != "weight":
            w = getattr(self, wname)
            return w.t() if wname == "weight_t" else self.weight_fn(w)
        return super().__getattr__(name)

    def _stored(self) -> Tensor:
        """The stored weight as the op reads it. A deferred one is its placeholder, in eager
        calls too: a folded model with deferred weights exists to be exported, and its eager
        calls (``export_signature``'s probe) only need shapes; computing each weight there
        would cost a weight-sized temporary per layer for nothing."""
        if self._deferred is not None:
            return self._deferred.placeholder_value(f"{self._path}.{self._wname}")
        return getattr(self, self._wname)

    def _stored_shape(self) -> tuple[int, ...]:
        if self._deferred is not None:
            return self._deferred.stored_shape
        return tuple(getattr(self, self._wname).shape)

    def forward(self, x: Tensor) -> Tensor:
        if self.gemm_2d and x.dim() != 2:
            # [.., K] -> [N', K] before the input Q/DQ, so the deploy model gets DQ -> Gemm -> Q
            # (QGemm, int32 bias inside) instead of MatMul + float bias Add.
            # Constant widths: a Shape of the output would force ORT to dequantize it.
            shape = self._stored_shape()
            y = self._forward(x.reshape(-1, shape[1]))
            return y.reshape(*x.shape[:-1], shape[0])
        return self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        if self.pre is not None:
            x = self.pre(x)
        if self._wname == "weight" and self._exports_transposed(x) and not torch.jit.is_tracing():
            self._store_transposed()
        w = self._stored()
        w = w if self.weight_fn is None else self.weight_fn(w)
        if self._wname == "weight_t":
            if not self._exports_transposed(x):
                return self._post(self._op(x, w.t(), self.bias))
            y = torch.matmul(x, w)
            return self._post(y if self.bias is None else self.bias + y)  # Add(bias, y), as the exporter's linear
        return self._post(self._op(x, w, self.bias))

    def _post(self, y: Tensor) -> Tensor:
        return y if self.post is None else self.post(y)

    def _exports_transposed(self, x: Tensor) -> bool:
        """A float Linear the exporter writes as MatMul(x, W^T): all but a 2-D input with a bias
        (Gemm)."""
        return self.kind == "linear" and self.weight_fn is None and (x.dim() != 2 or self.bias is None)

    @torch.no_grad()
    def _store_transposed(self) -> None:
        """Keep W^T ([in, out], ``weight_t``) instead of W. The exporter would otherwise fold
        Transpose(W) into a new initializer, a second copy of every such weight while it runs
        (a Llama's every Linear). Done at the first eager call (``export_signature``
        runs one before tracing); the file gets the same MatMul and Add as before."""
        if self._deferred is not None:
            self._deferred.transposed = True
        else:
            wt = self.weight.t().contiguous()
            del self.weight
            self.register_parameter("weight_t", nn.Parameter(wt, requires_grad=False))
        self._wname = "weight_t"


class QDQAct(nn.Module):
    """uint8 activation quantization (zero point = offset - qmin, INT8: offset + 128, numerically
    the same as the signed fake quant of ``fmt``); exports as QuantizeLinear -> DequantizeLinear."""

    def __init__(self, scale: float, offset: int, fmt: QuantFormat = INT8_ACT) -> None:
        super().__init__()
        self.scale = float(torch.tensor(scale, dtype=torch.float32))
        self.zero_point = int(offset) - fmt.qmin
        self.levels = fmt.levels

    def forward(self, x: Tensor) -> Tensor:
        return torch.fake_quantize_per_tensor_affine(x, self.scale, self.zero_point, 0, self.levels)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.8g}, zero_point={self.zero_point} (uint8)"


class _Dequantize(Function):
    """int8 -> float with per-axis (or one) scale and zero point; exports as one
    DequantizeLinear reading the int8 initializer itself."""

    @staticmethod
    def forward(ctx, q: Tensor, scale: Tensor, zero: Tensor, axis: int) -> Tensor:
        if is_placeholder(q):  # (values unused: see ``is_placeholder``)
            return zero_twin(q, torch.float32)
        shape = [1] * q.dim()
        if scale.dim():
            shape[axis] = -1
        return (q.float() - zero.float().reshape(shape)) * scale.reshape(shape)

    @staticmethod
    def symbolic(g, q, scale, zero, axis: int):
        return g.op("DequantizeLinear", q, scale, zero, axis_i=axis)


class WeightDQ(nn.Module):
    """The deploy model's weight: integer grid values of ``fmt`` (``quantize``) and the trained
    scales, per output channel on ``axis`` or one (``axis`` None). Stored as int8 in torch
    already (``element_types.storage_dtype``; an INT4 weight's values are int8 in -8..7), so
    exporting the deploy model carries a quarter of the float weight bytes."""

    def __init__(self, scales: Tensor, axis: int | None, fmt: QuantFormat = INT8_WEIGHT) -> None:
        super().__init__()
        self.axis = axis
        self.format = fmt
        self.dtype = storage_dtype(fmt)
        shape = () if axis is None else (-1,)
        self.register_buffer("scales", scales.detach().float().reshape(shape).clone())
        self.register_buffer("zeros", torch.zeros(self.scales.shape, dtype=self.dtype))

    def quantize(self, w: Tensor, out: Tensor | None = None) -> Tensor:
        """Grid values of the (already fake-quantized) float weight: round(w / s) as numpy's rint,
        into ``out`` when given. A slice of rows at a time: the float temporaries stay small
        (a weight-sized one per layer fragments the heap for the rest of a save)."""
        w = w.detach()
        out = torch.empty(w.shape, dtype=self.dtype) if out is None else out
        qmin, qmax = self.format.qmin, self.format.qmax
        s = self.scales
        if self.axis is not None:
            shape = [1] * w.dim()
            shape[self.axis] = -1
            s = s.reshape(shape)
        step = max(1, (1 << 20) // max(1, w[0].numel()))
        for r in range(0, w.shape[0], step):
            rows = slice(r, r + step)
            out[rows].copy_(torch.round(w[rows].float() / (s[rows] if self.axis == 0 else s)).clamp_(qmin, qmax))
        return out

    def forward(self, q: Tensor) -> Tensor:
        return _Dequantize.apply(q, self.scales, self.zeros, 0 if self.axis is None else self.axis)


def is_placeholder(t: Tensor) -> bool:
    """A deferred weight's placeholder, a zero view, or any tensor of one element repeated:
    values that mean nothing. A placeholder (``openamct.large.deferred``) carries the zero
    pages it lies in as ``_openamct_zeros`` (``holds``, ``twin``)."""
    if t.dim() == 0:
        return False
    zeros = getattr(t, "_openamct_zeros", None)  # (strides are never traced)
    return all(st == 0 for st in t.stride()) or (zeros is not None and zeros.holds(t))


def zero_twin(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Zeros of ``t``'s shape from the zero pages that made placeholder ``t``, one per ``t``
    (what an op on a placeholder returns); plain zeros for a zero-stride one."""
    zeros = getattr(t, "_openamct_zeros", None)
    return torch.zeros(t.shape, dtype=dtype) if zeros is None else zeros.twin(t, dtype)


def per_channel_view(w: Tensor, layer: CompressedLayer) -> tuple[Tensor, int]:
    if layer.kind == "linear_t":  # already transposed to [out, in] for export
        return w, 0
    """The weight with Cout on one axis (regrouped for grouped ConvTranspose) and that axis."""
    return to_channel_major(w, int(layer.weight_axis), int(layer.weight_groups))


# What a target file puts around one layer's op: ExportLayer keyword arguments (pre, weight_fn...).
Builder = Callable[[str, CompressedLayer, Tensor, ExportParts], dict]


@torch.no_grad()
def fold_layers(model: nn.Module, build: Builder, techniques: Sequence[Technique],
                defer: Callable | None = None) -> dict[str, ExportParts]:
    """Replace every CompressedLayer of ``model`` (a working copy) in place by
    an ExportLayer of the same class with ``build(name, layer, weight, parts)``'s extras;
    return each layer's ExportParts. A ``quantize`` extra (a ``WeightDQ``) stores the weight
    as int8.

    ``defer`` is the fold's branch point: the streamed save of a CPU model passes
    ``openamct.large.deferred.DeferredWeight``, and each layer then holds
    ``defer(layer, shape, quantize)`` instead of its weight: computed when read, and read as a
    placeholder while exported (``placeholder_value(key)``). The layers then read the working
    copy's compressed layers, so keep that copy unchanged. Without it, weights are folded now."""
    found = compressed_layers(model)
    if "" in found:
        raise ValueError("model: the root module itself is a compressed layer; wrap it in a container")
    out = {}
    for name, layer in found.items():
        layer.eval()
        if defer is not None and layer.bias is None and layer.bn is None:
            # Nothing to fold now: the builders need the weight's shape only, and a weight-sized
            # temporary per layer here fragments the heap for the whole save.
            w, b = torch.empty(layer.weight.shape, device="meta"), None
        else:
            w, b = layer.effective_weight_bias()  # the bias needs the weight's scales
        if layer.kind == "linear_t":
            w = w.t()  # exported as a Linear, so ONNX Runtime runs it as QGemm like any other
        parts = out[name] = export_parts(layer, techniques)
        extras = build(name, layer, w, parts)
        quantize = extras.pop("quantize", None)
        if defer is not None:
            weight = defer(layer, tuple(w.shape), quantize)
        else:
            weight = w.detach().float() if quantize is None else quantize.quantize(w)
        del w
        new = as_layer_class(ExportLayer, type(layer))(layer, weight, None if b is None else b.detach().float(),
                                                         **extras)
        new._path = name
        set_module(model, name, new)
    return out


def fold_activations(model: nn.Module, make: Callable[[float, int], nn.Module]) -> int:
    """Give every QuantizedActivation, output hook and MatMul input quantizer of ``model`` (a
    working copy) the export form of its quantizers, ``make(scale, offset)`` (FakeQuantAct or
    QDQAct); returns how many."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedActivation)]
    for name, m in found:
        new = m.with_quantizers(make).eval()
        for hook in m._forward_hooks.values():  # a residual site's output hook (quant/residual.py)
            new.register_forward_hook(hook)
        set_module(model, name, new)
    return len(found) + swap_hook_quantizers(model, make) + swap_matmul_quantizers(model, make)
