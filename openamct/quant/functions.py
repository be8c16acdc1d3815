"""Fake-quant arithmetic (docs/dev/reference.md, Algorithms): ULQ qparams, the per-tensor and
per-channel fake quant, and the ARQ and ULQ weight Functions (ULQ activations: ``ulq_act.py``).

Ranges. Each function takes the integer range from a ``QuantFormat`` (``openamct.formats``) passed
as an argument: INT8 (the default everywhere) for activations, INT8 or INT4 for weights.

Numerics. Every fake-quant here computes ``q = clamp(round(x * (1/s)) + zp, qmin, qmax)`` and
``y = (q - zp) * s`` in float32, which is exactly what torch's built-in
``fake_quantize_per_{tensor,channel}_affine`` kernels do (``nearbyint(x * inv_scale)``, round half
to even), written as a few vectorised tensor ops on every device: the built-ins are scalar loops
on the CPU (1 thread: 1.0 ms vs 0.07 ms for 262k activations, 10.5 ms vs 0.9 ms for a 512x512x3x3
weight), and the per-channel one checks an int32 zero point's range with two host reads per call.
Tests check the two are bit-identical. The built-ins are used only while a graph is captured for
export (they become QuantizeLinear/DequantizeLinear).

Weight layouts. Per-channel weight quantization is per *output* channel. Conv/Linear weights are
[Cout, Cin/g, *k] (axis 0). ConvTranspose weights are [Cin, Cout/g, *k]: output channel
``gi * Cout/g + j`` lives at rows ``gi*Cin/g ... (gi+1)*Cin/g - 1``, column ``j``. With groups == 1
that is simply axis 1; with groups > 1 the weight is regrouped as
``w.view(g, Cin/g, Cout/g, *k).transpose(0, 1).reshape(Cin/g, Cout, *k)`` so Cout is axis 1
(see ``to_channel_major``); scales are always returned in Cout order.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import Tensor
from torch.autograd import Function

from openamct.formats import INT8_ACT, INT8_WEIGHT, QuantFormat

logger = logging.getLogger(__name__)

__all__ = [
    "QMIN", "QMAX", "SCALE_EPS", "graph_mode", "ulq_qparams", "fake_quant_per_tensor",
    "fake_quant_per_channel", "to_channel_major", "from_channel_major", "arq_scales",
    "ulq_qparams_float", "ARQWeightFunction", "ULQWeightFunction",
    "arq_weight_fake_quant", "ulq_weight_fake_quant",
]

# INT8's range, for readers of the INT8 numbers (tests, benchmarks); the code here takes its
# range from the format it is given.
QMIN, QMAX = INT8_ACT.qmin, INT8_ACT.qmax
LEVELS = INT8_ACT.levels  # 255 = 2^b - 1
SCALE_EPS = float(torch.finfo(torch.float32).eps)  # floor for every scale (all-zero channels)


def graph_mode() -> bool:
    """True while a graph is captured for export; the built-in ops must then appear in it."""
    return bool(torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()
                or torch.compiler.is_exporting())


def _f32(v: float) -> float:
    return float(np.float32(v))


def _inv(s: float) -> float:
    # float32 division, as the built-in kernels compute inv_scale = 1.0f / scale.
    return float(np.float32(1.0) / np.float32(s))


# ---------------------------------------------------------------------------------------------
# ULQ activation quantization

def ulq_qparams(clip_max: Tensor, clip_min: Tensor, fixed_min,
                fmt: QuantFormat = INT8_ACT) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(scale, zero_point, cmax_used, cmin_used) as detached float32 0-dim tensors.

    cmax >= 0 >= cmin is enforced on the values used (the parameters keep their own values);
    ``fixed_min`` (bool or bool tensor) pins cmin at 0. zero_point = round(qmin - cmin/s)
    (INT8: -128).
    Used where no Python scalars may be taken (graph capture); ``ulq_qparams_float`` is the same
    arithmetic on Python floats for eager code (tests check they agree bit for bit).
    """
    cmax = clip_max.detach().float().clamp(min=0.0)
    cmin = clip_min.detach().float().clamp(max=0.0)
    if isinstance(fixed_min, Tensor):
        cmin = torch.where(fixed_min.to(cmin.device), torch.zeros_like(cmin), cmin)
    elif fixed_min:
        cmin = torch.zeros_like(cmin)
    scale = ((cmax - cmin) / fmt.levels).clamp(min=SCALE_EPS)
    zp = torch.round(fmt.qmin - cmin / scale).clamp(fmt.qmin, fmt.qmax)
    return scale, zp, cmax, cmin


class NonFiniteClip(ValueError):
    """A quantizer's clips give no grid (one is NaN, or both infinite)."""


def ulq_qparams_float(clip_max: float, clip_min: float, fixed_min: bool, fmt: QuantFormat = INT8_ACT
                      ) -> tuple[float, int, float, float]:
    """``ulq_qparams`` in float32 scalar arithmetic: (scale, zero_point, cmax_used, cmin_used)."""
    f = np.float32
    cmax = max(f(clip_max), f(0.0))
    cmin = f(0.0) if fixed_min else min(f(clip_min), f(0.0))
    scale = max((cmax - cmin) / f(fmt.levels), f(SCALE_EPS))
    zp = min(max(np.round(f(fmt.qmin) - cmin / scale), f(fmt.qmin)), f(fmt.qmax))
    if math.isnan(zp):  # (an infinite clip alone gives NaN outputs, which the training guard names)
        raise NonFiniteClip(f"activation clips are not finite (clip_max {clip_max}, clip_min {clip_min}): a "
                            "training step made them so (NaN or inf gradients; a lower learning rate or a "
                            "clipped gradient norm avoids it); restore from the last good checkpoint")
    return float(scale), int(zp), float(cmax), float(cmin)


def fake_quant_per_tensor(x: Tensor, scale, zero_point, qmin: int = QMIN, qmax: int = QMAX) -> Tensor:
    """Bit-identical to ``torch.fake_quantize_per_tensor_affine`` (no autograd: callers own that).
    ``scale``/``zero_point``: Python numbers, or 0-dim float32 tensors on ``x``'s device (no host
    read: ``1/s`` is the same float32 division as the built-in's ``inv_scale``)."""
    if isinstance(scale, Tensor):
        if graph_mode():
            return torch.fake_quantize_per_tensor_affine(x, scale, zero_point.to(torch.int32), qmin, qmax)
        y = torch.mul(x, torch.reciprocal(scale))
        y.round_()
        # clamp_ with tensor bounds runs a scalar loop on the CPU; maximum/minimum against a
        # 0-dim tensor vectorise (the same values, NaN included).
        torch.maximum(y, qmin - zero_point, out=y)
        torch.minimum(y, qmax - zero_point, out=y)
        return y.mul_(scale)
    if graph_mode():
        return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, qmin, qmax)
    y = torch.mul(x, _inv(scale))
    y.round_()
    y.clamp_(qmin - zero_point, qmax - zero_point)
    return y.mul_(scale)


# ---------------------------------------------------------------------------------------------
# Weight layouts and symmetric per-channel fake quant

def to_channel_major(w: Tensor, axis: int, groups: int = 1) -> tuple[Tensor, int]:
    """Return (w2, ch_axis): w2 holds the output channels on ch_axis (a view unless regrouped)."""
    if axis == 0 or groups == 1:
        return w, axis
    cin, cout_g = w.shape[0], w.shape[1]
    k = w.shape[2:]
    w2 = w.reshape(groups, cin // groups, cout_g, *k).transpose(0, 1)
    return w2.reshape(cin // groups, groups * cout_g, *k), 1


def from_channel_major(w2: Tensor, shape: torch.Size, axis: int, groups: int = 1) -> Tensor:
    """Inverse of ``to_channel_major``."""
    if axis == 0 or groups == 1:
        return w2
    cin, cout_g = shape[0], shape[1]
    w3 = w2.reshape(cin // groups, groups, cout_g, *shape[2:]).transpose(0, 1)
    return w3.reshape(shape)


def _absmax_per_channel(w2: Tensor, ch: int) -> Tensor:
    # max |w| in one reduction, no temporary (the infinity norm is exactly that maximum).
    return torch.linalg.vector_norm(w2, ord=math.inf, dim=[d for d in range(w2.dim()) if d != ch])


def arq_scales(w: Tensor, channel_wise: bool, axis: int = 0, groups: int = 1,
               fmt: QuantFormat = INT8_WEIGHT) -> Tensor:
    """ARQ scale(s), detached: max(|max|, |min|)/qmax (INT8: 127) per output channel (Cout
    order) or a 1-element tensor; floored at SCALE_EPS so all-zero channels stay finite."""
    with torch.no_grad():
        wd = w.detach()
        if channel_wise:
            w2, ch = to_channel_major(wd, axis, groups)
            amax = _absmax_per_channel(w2, ch)
        else:
            amax = torch.linalg.vector_norm(wd.reshape(-1), ord=math.inf, dim=0).reshape(1)
        return (amax.float() / fmt.qmax).clamp_(min=SCALE_EPS)


def _bshape(ndim: int, ch: int) -> list[int]:
    shape = [1] * ndim
    shape[ch] = -1
    return shape


def fake_quant_per_channel(w: Tensor, scale: Tensor, axis: int = 0, groups: int = 1,
                           clamp: bool = True, per_tensor: bool | None = None,
                           fmt: QuantFormat = INT8_WEIGHT) -> Tensor:
    """Symmetric (zero point 0) fake quant, range (qmin, qmax) of ``fmt`` (INT8: -128, 127);
    ``scale`` detached, Cout order or 1 element (``per_tensor``; inferred from its size when None,
    which graph capture warns about). Bit-identical to the built-in per-channel/per-tensor ops.
    ``clamp=False`` skips a pass when no value can leave the range (ARQ: |w/s| <= qmax)."""
    scale = scale.detach()
    if per_tensor is None:
        per_tensor = scale.numel() == 1
    if graph_mode():  # QuantizeLinear/DequantizeLinear in the exported graph
        qmin, qmax = fmt.qmin, fmt.qmax
        if fmt.bits < 8:
            # torch's ONNX exporters write 8-bit QuantizeLinear only: the weight is clamped into
            # the narrower grid's range first, and the 8-bit Q/DQ of the same scale then rounds
            # it onto that grid (clamp and round commute at integer bounds); a reader folds the
            # clamp of the constant weight (convert_qat_model) and finds the INT4 values.
            qmin, qmax = INT8_WEIGHT.qmin, INT8_WEIGHT.qmax
        if per_tensor:
            sf = scale.reshape(()).float()
            if fmt.bits < 8:
                w = torch.clamp(w, fmt.qmin * sf, fmt.qmax * sf)
            return torch.fake_quantize_per_tensor_affine(
                w, sf, torch.zeros((), dtype=torch.int32, device=w.device), qmin, qmax)
        w2, ch = to_channel_major(w, axis, groups)
        if fmt.bits < 8:
            s = scale.float().reshape(_bshape(w2.dim(), ch))
            w2 = torch.minimum(torch.maximum(w2, fmt.qmin * s), fmt.qmax * s)
        zp = torch.zeros(scale.numel(), dtype=torch.int32, device=w.device)
        y2 = torch.fake_quantize_per_channel_affine(w2, scale.float(), zp, ch, qmin, qmax)
        return from_channel_major(y2, w.shape, axis, groups)
    if per_tensor:
        sf = scale.reshape(()).float()
        if clamp:
            return fake_quant_per_tensor(w, sf, torch.zeros((), device=w.device), fmt.qmin, fmt.qmax)
        return torch.mul(w, torch.reciprocal(sf)).round_().mul_(sf)
    w2, ch = to_channel_major(w, axis, groups)
    s = scale.reshape(_bshape(w2.dim(), ch))
    y = torch.mul(w2, s.reciprocal())
    y.round_()
    if clamp:
        y.clamp_(fmt.qmin, fmt.qmax)
    y.mul_(s)
    return from_channel_major(y, w.shape, axis, groups)


class ARQWeightFunction(Function):
    """ARQ: scale recomputed from w each call; backward is the identity (nothing is clipped)."""

    @staticmethod
    def forward(ctx, w: Tensor, channel_wise: bool, axis: int, groups: int, scales: Tensor,
                fmt: QuantFormat = INT8_WEIGHT) -> Tensor:
        return fake_quant_per_channel(w, scales, axis, groups, clamp=False, per_tensor=not channel_wise, fmt=fmt)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None, None, None, None, None


def arq_weight_fake_quant(w: Tensor, channel_wise: bool, axis: int = 0, groups: int = 1,
                          scales: Tensor | None = None, fmt: QuantFormat = INT8_WEIGHT) -> Tensor:
    """``scales``: ``arq_scales`` of this ``w`` (and ``fmt``) when the caller already has them."""
    if scales is None:
        scales = arq_scales(w, channel_wise, axis, groups, fmt)
    if graph_mode() or not (torch.is_grad_enabled() and w.requires_grad):
        return fake_quant_per_channel(w, scales, axis, groups, clamp=False, per_tensor=not channel_wise, fmt=fmt)
    return ARQWeightFunction.apply(w, channel_wise, axis, groups, scales, fmt)


class ULQWeightFunction(Function):
    """ULQ weights: learnable scale, STE (identity) for w as upstream, LSQ gradient for the scale:
    ds = sum(g * c) / sqrt(n * qmax) per channel, c = round(w/s) - w/s in range, qmin / qmax when
    clipped below / above (n = elements per scale; INT8: qmin -128, qmax 127)."""

    @staticmethod
    def forward(ctx, w: Tensor, scale: Tensor, axis: int, groups: int, per_tensor: bool,
                fmt: QuantFormat = INT8_WEIGHT) -> Tensor:
        s = scale.detach().float().clamp(min=SCALE_EPS)
        ctx.save_for_backward(w, s)
        ctx.layout = (axis, groups, per_tensor, fmt)
        return fake_quant_per_channel(w, s, axis, groups, clamp=True, per_tensor=per_tensor, fmt=fmt)

    @staticmethod
    def backward(ctx, g: Tensor):
        w, s = ctx.saved_tensors
        axis, groups, per_tensor, fmt = ctx.layout
        qmin, qmax = fmt.qmin, fmt.qmax
        grad_s = None
        if ctx.needs_input_grad[1]:
            w2, ch = (w, 0) if per_tensor else to_channel_major(w, axis, groups)
            g2 = g if per_tensor else to_channel_major(g, axis, groups)[0]
            sb = s.reshape(()) if per_tensor else s.reshape(_bshape(w2.dim(), ch))
            r = w2.float() / sb
            q = torch.round(r).clamp_(qmin, qmax)
            coef = torch.where((r >= qmin) & (r <= qmax), q - r, q)
            prod = coef.mul_(g2.float())
            n = w.numel() // s.numel()
            if per_tensor:
                grad_s = prod.sum().reshape(1)
            else:
                grad_s = prod.transpose(0, ch).reshape(s.numel(), -1).sum(dim=1)
            grad_s = grad_s / math.sqrt(n * qmax)
        return g, grad_s, None, None, None, None


def ulq_weight_fake_quant(w: Tensor, scale: Tensor, axis: int = 0, groups: int = 1,
                          channel_wise: bool = True, fmt: QuantFormat = INT8_WEIGHT) -> Tensor:
    if graph_mode() or not (torch.is_grad_enabled() and (w.requires_grad or scale.requires_grad)):
        return fake_quant_per_channel(w, scale.detach().float().clamp(min=SCALE_EPS), axis, groups,
                                      per_tensor=not channel_wise, fmt=fmt)
    return ULQWeightFunction.apply(w, scale, axis, groups, not channel_wise, fmt)
