"""ULQ activation fake quant with learnable clips (docs/dev/reference.md, Algorithms): the
forward is the built-in formula, the backward upstream's. One autograd Function runs on every
device, with the quantization parameters as tensors on the input's device (``act_qparams``):
no value is read back to the host and no table is copied to the device.

Forward, in code units ``t = x * (1/s)``: ``y = clamp(round(t), qmin - zp, qmax - zp) * s``,
bit for bit torch's ``fake_quantize_per_tensor_affine`` (round half to even), in four or five
element-wise ops (a ``fixed_min`` quantizer's bounds are the constants 0 and levels).

Backward. In range means y_lo <= x <= y_hi (the outermost representable levels, as upstream):
dx = g in range, 0 outside. With e = (round(r) - r)/levels and r = clip(x)/s:
dcmax = sum((e + upper) g), dcmin = sum((lower - e) g). The input clamped to the range, x_c,
gives all of it: ``sat = sign(x_c - x)`` (+1 below, -1 above, 0 in range), ``d = round(x_c/s) -
x_c/s`` (finite even where x is inf), and one matrix-vector product of those terms with the
gradient, which the row's ``coef`` turns into both clip gradients (``act_qparams``): a dozen ops,
every one on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import Function

from openamct.formats import INT8_ACT, QuantFormat
from openamct.quant.act_qparams import ActQParams, _autocast_on, compute_rows, constants, row_of
from openamct.quant.act_qparams import no_autocast as _no_autocast
from openamct.quant.functions import graph_mode, ulq_qparams

__all__ = ["ULQAct", "ulq_act_fake_quant", "fake_quant_codes"]


def fake_quant_codes(x: Tensor, p: ActQParams) -> Tensor:
    """``x`` fake-quantized with row ``p`` (a new tensor; no autograd)."""
    y = torch.mul(x, p.inv)
    y.round_()
    if p.fixed:
        y.clamp_(0, p.fmt.levels)  # lo = 0, hi = levels: scalar bounds, one vectorised pass
    else:
        torch.maximum(y, p.lo, out=y)
        torch.minimum(y, p.hi, out=y)
    return y.mul_(p.scale)


class ULQAct(Function):
    """``apply(x, clip_max, clip_min, p)`` with ``p`` the clips' ``ActQParams``."""

    @staticmethod
    def forward(ctx, x: Tensor, clip_max: Tensor, clip_min: Tensor, p: ActQParams) -> Tensor:
        # Only x is kept: y is not, so code after the quantizer may modify its output in place
        # (HF ResNet's ``hidden_state += residual`` on a quantized conv output).
        ctx.save_for_backward(x)
        ctx.p, ctx.pdtype = p, clip_max.dtype
        return fake_quant_codes(x, p)

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        p = ctx.p
        need_x = ctx.needs_input_grad[0]
        need_clips = ctx.needs_input_grad[1] or (ctx.needs_input_grad[2] and not p.fixed)
        with _no_autocast(x):
            g = g.to(x.dtype)
            xc = torch.clamp(x, min=0.0) if p.fixed else torch.maximum(x, p.y_lo)
            torch.minimum(xc, p.y_hi, out=xc)
            if not need_clips:
                return (torch.where(xc == x, g, 0.0) if need_x else None), None, None, None
            # The three terms of the clip gradients, side by side for one matrix-vector product:
            # t - round(t), sat = sign(x_c - x) and |sat| (act_qparams, "Gradient coefficients").
            terms = torch.empty((3, *x.shape), dtype=x.dtype, device=x.device)
            t = torch.mul(xc, p.inv, out=terms[0])
            t.sub_(torch.round(t))
            sat = torch.sub(xc, x, out=terms[1]).sign_()
            out = torch.abs(sat, out=terms[2])
            del xc
            gx = torch.addcmul(g, g, out, value=-1.0) if need_x else None  # g in range, 0 outside
            grads = torch.mv(p.coef, torch.mv(terms.view(3, -1), g.reshape(-1))).to(ctx.pdtype)
        return gx, grads[0], (None if p.fixed else grads[1]), None


def ulq_act_fake_quant(x: Tensor, clip_max: Tensor, clip_min: Tensor, fixed_min: bool,
                       fmt: QuantFormat = INT8_ACT, params: ActQParams | None = None) -> Tensor:
    """ULQ fake quant of ``x``: the built-in op with tensor qparams while a graph is captured for
    export (it becomes QuantizeLinear/DequantizeLinear), otherwise ``ULQAct`` when a gradient is
    needed and the plain forward when not. ``params``: the clips' row when the caller has it
    (a ``QParamTable``'s); computed here otherwise.

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
            y = ulq_act_fake_quant(x.float(), clip_max, clip_min, fixed, fmt, params)
        return y if amp else y.to(x.dtype)
    p = params if params is not None else single_row(clip_max, clip_min, fixed, fmt)
    if torch.is_grad_enabled() and (x.requires_grad or clip_max.requires_grad
                                    or (clip_min.requires_grad and not fixed)):
        return ULQAct.apply(x, clip_max, clip_min, p)
    return fake_quant_codes(x, p)


def single_row(clip_max: Tensor, clip_min: Tensor, fixed: bool, fmt: QuantFormat) -> ActQParams:
    """The row of one pair of clips, computed now with no host-side cache (callers without a
    table, and compiled code: a compiler fuses the small ops and guards on nothing here)."""
    with torch.no_grad():
        clips = torch.stack((clip_max.detach(), clip_min.detach())).view(1, 2)
        pinned = torch.full((1, 2), fixed, dtype=torch.bool, device=clips.device)
        pinned[:, 0] = False
        rows = compute_rows(clips, pinned, fmt, constants(fmt, clips.device))
    return row_of(rows, 0, fixed, fmt)
