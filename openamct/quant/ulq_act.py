"""ULQ activation fake quant with learnable clips (docs/dev/reference.md, Algorithms): the
forward is the built-in formula (``functions.fake_quant_per_tensor``), the backward upstream's.

In range means y_min <= x <= y_max (the outermost representable levels, as upstream). dx = g in
range, 0 outside. With e = (round(r) - r)/levels and r = clip(x)/s: dcmax = sum((e + upper) g),
dcmin = sum((lower - e) g). In range round(r) - r = (y - x)/s, so that part is one dot product;
out of range r is the constant cmax/s or cmin/s.

Two Functions compute this, with the same formulas:
- ``ULQActFunction`` takes the qparams as 0-dim float32 tensors on the input's device and never
  reads them back to the host, so a training step on an accelerator never waits here. It is the
  path on every device but the CPU, and whenever the code is traced or compiled.
- ``ULQActHostFunction`` takes them as Python numbers. On the CPU a 0-dim tensor's value is a
  plain memory read (``Tensor.numpy``: no dispatch, nothing to wait for), and scalar bounds let
  the in-range mask, the clamp and the fake quant each run as one vectorised pass
  (``hardtanh_backward``, ``clamp_``). With tensor bounds the CPU needs extra full-size passes and
  temporaries (maximum/minimum, a mask), which made this backward about 1.5x slower.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from torch import Tensor
from torch.autograd import Function

from openamct.formats import INT8_ACT, QuantFormat
from openamct.quant.functions import (
    _composite_ok,
    _f32,
    fake_quant_per_tensor,
    graph_mode,
    ulq_qparams,
    ulq_qparams_float,
)

__all__ = ["ULQActFunction", "ULQActHostFunction", "ulq_act_fake_quant"]

_HTB = torch.ops.aten.hardtanh_backward


def _autocast_on(x: Tensor) -> bool:
    try:
        return torch.is_autocast_enabled(x.device.type)
    except (TypeError, RuntimeError):  # torch < 2.4 has no device argument; meta has no autocast
        return False


def _no_autocast(x: Tensor):
    """Autocast off for ``x``'s device while a quantizer computes in float32 (a context)."""
    return torch.autocast(x.device.type, enabled=False) if _autocast_on(x) else contextlib.nullcontext()


def _tensor_qparams(qparams, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``ulq_qparams``' four 0-dim float32 tensors on ``like``'s device (floats accepted)."""
    return tuple(q if isinstance(q, Tensor) else torch.tensor(float(q), dtype=torch.float32, device=like.device)
                 for q in qparams)


def _combine(s_in, g_up, g_lo, e_up, e_lo, fixed_min: bool, pdtype) -> tuple[Tensor, Tensor | None]:
    """(dcmax, dcmin) from the in-range sum and the gradient mass above and below the range."""
    grad_max = s_in + (1.0 + e_up) * g_up
    grad_min = None
    if not fixed_min:  # fixed_min pins cmin at 0: e_lo = 0 and no clip_min gradient
        grad_max = grad_max + e_lo * g_lo
        grad_min = (-s_in - e_up * g_up + (1.0 - e_lo) * g_lo).to(pdtype)
    return grad_max.to(pdtype), grad_min


class ULQActFunction(Function):
    """``apply(x, clip_max, clip_min, fixed_min, qparams, fmt)`` with ``qparams = ulq_qparams(...)``
    of the same clips and format (0-dim float32 tensors; ``ulq_qparams_float``'s numbers are
    accepted too). No host read."""

    @staticmethod
    def forward(ctx, x: Tensor, clip_max: Tensor, clip_min: Tensor, fixed_min: bool, qparams,
                fmt: QuantFormat = INT8_ACT) -> Tensor:
        qp = _tensor_qparams(qparams, x)
        y = fake_quant_per_tensor(x, qp[0], qp[1], fmt.qmin, fmt.qmax)
        # Only x is kept: y is recomputed in backward, so code after the quantizer may modify its
        # output in place (HF ResNet's ``hidden_state += residual`` on a quantized conv output).
        ctx.save_for_backward(x, *qp)
        ctx.consts = (bool(fixed_min), clip_max.dtype, fmt)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        x, s, zp, cmax, cmin = ctx.saved_tensors
        fixed_min, pdtype, fmt = ctx.consts
        with _no_autocast(x):
            g = g.to(x.dtype)
            y_lo, y_hi = (fmt.qmin - zp) * s, (fmt.qmax - zp) * s  # float32, as the scalar code rounded them
            # clamp with tensor bounds is a scalar loop on the CPU (traced code lands here), so
            # the bounds are applied with maximum/minimum against 0-dim tensors.
            x_c = torch.maximum(x, y_lo)
            torch.minimum(x_c, y_hi, out=x_c)
            gx = g.masked_fill(torch.ne(x_c, x), 0.0)  # g in range, 0 outside
            grad_max = grad_min = None
            if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
                # y - x in range (y of the clamped input: finite even where x is inf); outside,
                # where gx is 0, x_c sits on the outermost level and y - x_c is 0 anyway.
                y = fake_quant_per_tensor(x_c, s, zp, fmt.qmin, fmt.qmax)
                s_in = torch.dot(y.sub_(x_c).reshape(-1), gx.reshape(-1)) / (fmt.levels * s)
                sat = x_c.sub_(x).neg_().sign_()  # +1 above y_hi, -1 below y_lo, 0 in range
                g_diff = torch.dot(g.reshape(-1), sat.reshape(-1))  # g_up - g_lo
                g_sum = g.sum() - gx.sum()  # g_up + g_lo
                g_up, g_lo = (g_sum + g_diff) / 2, (g_sum - g_diff) / 2
                e_up = (torch.round(cmax / s) - cmax / s) / fmt.levels
                e_lo = (torch.round(cmin / s) - cmin / s) / fmt.levels
                grad_max, grad_min = _combine(s_in, g_up, g_lo, e_up, e_lo, fixed_min, pdtype)
        return (gx if ctx.needs_input_grad[0] else None), grad_max, grad_min, None, None, None


class ULQActHostFunction(Function):
    """``apply(x, clip_max, clip_min, fixed_min, qparams, fmt)`` with ``qparams =
    ulq_qparams_float(...)`` (Python numbers): the CPU path."""

    @staticmethod
    def forward(ctx, x: Tensor, clip_max: Tensor, clip_min: Tensor, fixed_min: bool, qparams,
                fmt: QuantFormat = INT8_ACT) -> Tensor:
        y = fake_quant_per_tensor(x, qparams[0], qparams[1], fmt.qmin, fmt.qmax)
        ctx.save_for_backward(x)  # not y: see ULQActFunction
        ctx.consts = (tuple(qparams), bool(fixed_min), clip_max.dtype, fmt)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        (s, zp, cmax, cmin), fixed_min, pdtype, fmt = ctx.consts
        with _no_autocast(x):
            g = g.to(x.dtype)
            y_lo, y_hi = _f32((fmt.qmin - zp) * s), _f32((fmt.qmax - zp) * s)
            below = float(np.nextafter(np.float32(y_lo), np.float32(-np.inf)))
            above = float(np.nextafter(np.float32(y_hi), np.float32(np.inf)))
            # hardtanh_backward(g, x, lo, hi) = g where lo < x < hi else 0: one fused pass.
            gx = _HTB(g, x, below, above)
            grad_max = grad_min = None
            if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
                d = fake_quant_per_tensor(x, s, zp, fmt.qmin, fmt.qmax).sub_(x)
                # where x is +-inf, y - x is infinite and gx 0: a zero keeps the dot finite, as
                # the device path's clamped input does; NaN stays NaN there and here.
                torch.nan_to_num_(d, nan=math.nan, posinf=0.0, neginf=0.0)
                s_in = torch.dot(d.reshape(-1), gx.reshape(-1)) / (fmt.levels * s)
                g_up = _HTB(g, x, y_hi, math.inf).sum()
                g_lo = g.sum() - gx.sum() - g_up
                e_up = _f32((round(cmax / s) - cmax / s) / fmt.levels)
                e_lo = _f32((round(cmin / s) - cmin / s) / fmt.levels)
                grad_max, grad_min = _combine(s_in, g_up, g_lo, e_up, e_lo, fixed_min, pdtype)
        return (gx if ctx.needs_input_grad[0] else None), grad_max, grad_min, None, None, None


def _host_value(t: Tensor) -> float:
    """A CPU 0-dim tensor's value through numpy: a memory read, not a dispatched ``.item()``."""
    return float(t.detach().numpy())


def ulq_act_fake_quant(x: Tensor, clip_max: Tensor, clip_min: Tensor, fixed_min,
                       fmt: QuantFormat = INT8_ACT) -> Tensor:
    """Dispatch: built-in op with tensor qparams while exporting, an autograd Function when a
    gradient is needed, the plain (composite or built-in) op otherwise. ``fixed_min``: a bool
    (``ActULQ`` passes its host copy; a tensor is read). On the CPU the clips are read as numbers
    (``ULQActHostFunction``); elsewhere, and while traced, they stay tensors on the device.

    Autocast-safe: a bf16/fp16 input is quantized as its float32 cast, with autocast off
    (fp16 sums of a large activation overflow, and the grid needs float32 scales); the output
    is float32 under autocast (the next op casts it as autocast decides), else ``x``'s dtype."""
    if graph_mode():
        scale, zp, _, _ = ulq_qparams(clip_max, clip_min, fixed_min, fmt)
        return torch.fake_quantize_per_tensor_affine(
            x, scale.to(x.device), zp.to(device=x.device, dtype=torch.int32), fmt.qmin, fmt.qmax)
    fixed = bool(fixed_min)
    if x.is_floating_point() and x.dtype != torch.float32:
        amp = _autocast_on(x)
        with _no_autocast(x):
            y = ulq_act_fake_quant(x.float(), clip_max, clip_min, fixed, fmt)
        return y if amp else y.to(x.dtype)
    host = _composite_ok(x) and clip_max.device.type == "cpu" and clip_min.device.type == "cpu"
    if host:
        qp = ulq_qparams_float(_host_value(clip_max), _host_value(clip_min), fixed, fmt)
    else:
        qp = ulq_qparams(clip_max, clip_min, fixed, fmt)
    if torch.is_grad_enabled() and (x.requires_grad or clip_max.requires_grad
                                    or (clip_min.requires_grad and not fixed)):
        fn = ULQActHostFunction if host else ULQActFunction
        return fn.apply(x, clip_max, clip_min, fixed, qp, fmt)
    return fake_quant_per_tensor(x, qp[0], qp[1], fmt.qmin, fmt.qmax)
