"""Clip gradients for a first layer's input quantizer without the op's backward-data pass.

When the input needs no gradient (the image) but its quantizer's clips do, autograd would run
the op's backward-data only to get dL/dx_q for the clips (for a 3-channel stem conv that costs
several forward convs); ``input_clip_grad`` gets the same clip gradients from one forward op
on (x_q - x) instead.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import Function

from openamct.formats import INT8_ACT, QuantFormat


class _InputClipGrad(Function):
    """Identity on a linear op's output ``out = op(x_q, w)``; its backward adds the ULQ clip
    gradients of x_q = ULQ(x) when x itself needs no gradient. By linearity of op,
    sum(dL/dx_q * c) = sum(dL/dout * op(c, w)) for the per-element coefficient c of each clip:
    one forward op for clip_max, one more for clip_min (on the saturation mask)."""

    @staticmethod
    def forward(ctx, out, clip_max, clip_min, x, xq, w, qparams, fixed_min, op, fmt):
        ctx.save_for_backward(x, xq, w, *qparams)
        ctx.consts = (fixed_min, op, clip_max.dtype, fmt)
        # Returned as itself, declared "modified in place": a view would forbid a following
        # in-place op (ReLU(inplace=True)), a clone would cost a pass and memory.
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, g_out):
        x, xq, w, s, zp, cmax, cmin = ctx.saved_tensors
        fixed_min, op, pdtype, fmt = ctx.consts
        levels = fmt.levels
        w = w.detach().float()  # float32 sums, whatever dtype autocast gave the op
        y_lo, y_hi = (fmt.qmin - zp) * s, (fmt.qmax - zp) * s
        g = g_out.reshape(-1).float()
        grad_min = None
        # Saturated inputs take their clip's constant coefficient; the rest (x_q - x) / (levels s).
        # One path whether anything saturates or not: telling the two apart would cost a host
        # read per step.
        e_up = (torch.round(cmax / s) - cmax / s) / levels
        e_lo = (torch.round(cmin / s) - cmin / s) / levels
        up, lo = x > y_hi, x < y_lo
        c_max = torch.where(up, 1.0 + e_up, torch.where(lo, e_lo, (xq - x) / (levels * s)))
        grad_max = torch.dot(g, op(c_max, w, None).reshape(-1))
        if not fixed_min:  # c_min = saturated - c_max
            sat = (up | lo).to(x.dtype)
            grad_min = torch.dot(g, op(sat, w, None).reshape(-1)) - grad_max
        return (g_out, grad_max.to(pdtype), None if fixed_min else grad_min.to(pdtype),
                None, None, None, None, None, None, None)


def input_clip_grad(out: Tensor, clip_max: Tensor, clip_min: Tensor, x: Tensor, xq: Tensor,
                    w: Tensor, qparams: tuple[Tensor, Tensor, Tensor, Tensor], fixed_min: bool,
                    op, fmt: QuantFormat = INT8_ACT) -> Tensor:
    """``out`` (= op(xq, w, b)) unchanged, plus clip gradients for xq = ULQ(x); see _InputClipGrad.
    ``qparams``: ``ulq_qparams`` of the clips (tensors on the device) in format ``fmt``."""
    return _InputClipGrad.apply(out, clip_max, clip_min, x, xq, w, qparams, fixed_min, op, fmt)


