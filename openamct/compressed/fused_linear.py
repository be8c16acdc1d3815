"""The training step of a compressed Linear (2:4 mask and/or ARQ weights, no BN) as one
autograd Function that builds the effective weight in a scratch tensor shared by all layers.

Why (issue 19). The composed path allocates two weight-sized tensors per layer per step (the
masked weight, then the fake-quantized one that ``F.linear`` keeps for backward). Above glibc's
mmap threshold (32 MB at most: a 2048x5632 Linear is 46 MB) every such allocation is a fresh
mapping, so each step page-faults and zeroes them again; at 1.1B parameters that made the QAT
step 3.5x a plain FP32 step, and the kept copy held a second float copy of every weight for the
whole backward. Here the effective weight lives in one scratch tensor per thread, as large as
the largest layer, which stays mapped and in use: forward writes it, the matmul reads it, and
backward writes it again from the saved weight, mask and scales (five cheap passes) to get the
input gradient. So training holds no per-layer copy, and a step maps no new weight pages.

Numerics: the same ops, in the same order, as ``_MaskSTE`` -> ``ARQWeightFunction`` ->
``F.linear``, so outputs and gradients are bit-identical to the composed path (tests).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor
from torch.autograd import Function

from openamct.prune.nm import apply_mask
from openamct.quant.functions import QMAX, SCALE_EPS, _absmax_per_channel, _bshape, graph_mode


class _Scratch(threading.local):
    """One flat tensor per thread and (dtype, device), grown to the largest weight seen."""

    def __init__(self) -> None:
        self.tensors: dict[tuple, Tensor] = {}

    def take(self, like: Tensor) -> Tensor:
        key = (like.dtype, like.device)
        flat = self.tensors.get(key)
        if flat is None or flat.numel() < like.numel():
            self.tensors.pop(key, None)  # free the smaller one before mapping the larger
            flat = self.tensors[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return flat[:like.numel()].view(like.shape)


_scratch = _Scratch()


def release_scratch() -> None:
    """Give the scratch memory back (eval and save call it; the next training step re-maps it)."""
    _scratch.tensors.clear()


def _effective(w: Tensor, mask: Tensor | None, channel_wise: bool | None, axis: int,
               out: Tensor, scales: Tensor | None = None) -> Tensor | None:
    """Write mask(w), fake-quantized when ``channel_wise`` is not None, into ``out``; return
    the ARQ scales (output channels on ``axis``, or 1 element; computed unless given) or None."""
    if mask is None:
        out.copy_(w)
    else:
        apply_mask(w, mask, out)
    if channel_wise is None:
        return None
    if scales is None:
        if channel_wise:
            amax = _absmax_per_channel(out, axis)
        else:
            amax = torch.maximum(out.amax(), out.amin().neg()).reshape(1)
        scales = (amax.float() / QMAX).clamp_(min=SCALE_EPS)
    s = scales.reshape(_bshape(out.dim(), axis)) if channel_wise else scales.reshape(())
    out.mul_(s.reciprocal()).round_().mul_(s)
    return scales


class _MaskedQuantLinear(Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, mask: Tensor | None,
                channel_wise: bool | None, transposed: bool):
        weff = _scratch.take(w)
        with torch.no_grad():
            scales = _effective(w, mask, channel_wise, int(transposed), weff)
        y = torch.nn.functional.linear(x, weff.t() if transposed else weff, b)
        ctx.save_for_backward(x, w, mask, scales)
        ctx.meta = (channel_wise, transposed, b is not None)
        if scales is not None:
            ctx.mark_non_differentiable(scales)
        return y, scales

    @staticmethod
    def backward(ctx, g: Tensor, _gs):
        x, w, mask, scales = ctx.saved_tensors
        channel_wise, transposed, has_bias = ctx.meta
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        if need_x:
            weff = _scratch.take(w)
            _effective(w, mask, channel_wise, int(transposed), weff, scales)
            gx = g.mm(weff.t() if transposed else weff)
        if need_w:  # straight through the mask and the quantizer (SPEC §4)
            gw = x.t().mm(g) if transposed else g.t().mm(x)
        if need_b and has_bias:
            gb = g.sum(0)
        return gx, gw, gb, None, None, None


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 has no device argument
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def fused_ok(x: Tensor, w: Tensor) -> bool:
    """Eager training forward on a plain float weight, outside autocast (whose casts the
    composed path's autograd carries through backward, and this Function would not)."""
    return (torch.is_grad_enabled() and w.requires_grad and w.is_floating_point()
            and x.dim() >= 1 and not graph_mode() and not _autocast_on(x.device.type))


def masked_quant_linear(x: Tensor, w: Tensor, b: Tensor | None, mask: Tensor | None,
                        channel_wise: bool | None, transposed: bool) -> tuple[Tensor, Tensor | None]:
    """(y, ARQ scales or None): ``F.linear(x, q(w * mask), b)`` (``w.t()`` when
    ``transposed``, HF Conv1D's layout) with straight-through gradients for ``w``."""
    # The Function sees 2-D rows: its output is then a tensor of its own, not a view, so model
    # code may modify it in place (HF Wav2Vec2 does); the reshape outside is tracked as usual.
    y, scales = _MaskedQuantLinear.apply(x.reshape(-1, x.shape[-1]), w, b, mask, channel_wise, transposed)
    return y.reshape(*x.shape[:-1], y.shape[-1]), scales
