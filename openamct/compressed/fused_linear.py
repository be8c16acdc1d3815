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

import torch
from torch import Tensor
from torch.autograd import Function

from openamct._workspace import Workspace
from openamct.prune.nm import apply_bits_rows
from openamct.quant.functions import QMAX, SCALE_EPS, _absmax_per_channel, _bshape, graph_mode

_scratch = Workspace()  # one effective weight per thread, as large as the largest layer


def release_scratch() -> None:
    """Give the scratch memory back (eval and save call it; the next training step re-maps it)."""
    _scratch.release()


_CHUNK_ELEMS = 1 << 20  # 4 MB of float32 per slice: it stays in cache across the passes on it


def _row_slices(w: Tensor):
    rows = w.shape[0]
    step = max(1, _CHUNK_ELEMS // max(1, w[0].numel())) if rows else 1
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def _effective(w: Tensor, mask: Tensor | None, channel_wise: bool | None, axis: int,
               out: Tensor, scales: Tensor | None = None) -> Tensor | None:
    """Write mask(w) (``mask``: packed, ``mask_bits``' layout), fake-quantized when
    ``channel_wise`` is not None, into ``out``; return
    the ARQ scales (output channels on ``axis``, or 1 element; computed unless given) or None.

    A slice of rows at a time (issue 19): the mask, the scales' reduction and the three
    quantize passes then run on 4 MB that stays in cache, instead of six trips through memory
    over the whole weight. Every element gets the same ops as on the whole tensor (a max is
    exact in any order), so the result is bit-identical."""
    parts = _row_slices(w)
    row_scales = channel_wise and axis == 0 and scales is None  # each slice holds whole channels
    if channel_wise is None or scales is not None or row_scales:
        if row_scales:
            scales = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        for rows in parts:
            o = _masked_into(w, mask, rows, out[rows])
            if channel_wise is None:
                continue
            if row_scales:
                scales[rows] = (_absmax_per_channel(o, 0).float() / QMAX).clamp_(min=SCALE_EPS)
                _quantize_(o, scales[rows], channel_wise, 0)
            else:
                _quantize_(o, scales if axis != 0 or not channel_wise else scales[rows], channel_wise, axis)
        return scales
    # Scales over all rows (per tensor, or per column of HF's Conv1D layout): mask first.
    amax = None
    for rows in parts:
        o = _masked_into(w, mask, rows, out[rows])
        part = _absmax_per_channel(o, axis) if channel_wise else torch.maximum(o.amax(), o.amin().neg()).reshape(1)
        amax = part if amax is None else torch.maximum(amax, part)
    scales = (amax.float() / QMAX).clamp_(min=SCALE_EPS)
    for rows in parts:
        _quantize_(out[rows], scales, channel_wise, axis)
    return scales


def _masked_into(w: Tensor, bits: Tensor | None, rows: slice, out: Tensor) -> Tensor:
    return out.copy_(w[rows]) if bits is None else apply_bits_rows(w, bits, rows, out)


def _quantize_(o: Tensor, scales: Tensor, channel_wise: bool, axis: int) -> None:
    s = scales.reshape(_bshape(o.dim(), axis)) if channel_wise else scales.reshape(())
    o.mul_(s.reciprocal()).round_().mul_(s)


class _MaskedQuantLinear(Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, mask: Tensor | None,
                channel_wise: bool | None, transposed: bool):
        weff = _scratch.take_like("weight", w)
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
            weff = _scratch.take_like("weight", w)
            _effective(w, mask, channel_wise, int(transposed), weff, scales)
            gx = g.mm(weff.t() if transposed else weff)
        if need_w:  # straight through the mask and the quantizer (SPEC §4)
            gw = x.t().mm(g) if transposed else g.t().mm(x)
        if need_b and has_bias:
            gb = g.sum(0)
        return gx, gw, gb, None, None, None


@torch.no_grad()
def eval_weight(w: Tensor, mask: Tensor | None, channel_wise: bool | None, transposed: bool
                ) -> tuple[Tensor, Tensor | None]:
    """(effective weight, ARQ scales or None) of an eval forward without autograd, built in the
    shared scratch: valid until the next call. Eval otherwise allocated two or three new
    weight-sized tensors per layer, which above glibc's mmap threshold are fresh pages every
    forward (at 1.1B parameters most of the eval forward's time, issue 19)."""
    weff = _scratch.take_like("weight", w)
    return weff, _effective(w.detach(), mask, channel_wise, int(transposed), weff)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 has no device argument
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def _eager_float(x: Tensor, w: Tensor) -> bool:
    """A float weight, outside graph capture and autocast (whose casts the composed path's
    autograd carries through backward, and the fused Function would not)."""
    return w.is_floating_point() and not graph_mode() and not _autocast_on(x.device.type)


def eval_ok(x: Tensor, w: Tensor) -> bool:
    """An eager forward without autograd on a plain float weight, outside autocast."""
    return not torch.is_grad_enabled() and _eager_float(x, w)


def fused_ok(x: Tensor, w: Tensor) -> bool:
    """Eager training forward on a plain float weight, outside autocast."""
    return torch.is_grad_enabled() and w.requires_grad and x.dim() >= 1 and _eager_float(x, w)


def masked_quant_linear(x: Tensor, w: Tensor, b: Tensor | None, mask: Tensor | None,
                        channel_wise: bool | None, transposed: bool) -> tuple[Tensor, Tensor | None]:
    """(y, ARQ scales or None): ``F.linear(x, q(w * mask), b)`` (``w.t()`` when
    ``transposed``, HF Conv1D's layout) with straight-through gradients for ``w``; ``mask`` is
    packed (``NMSparsifier.mask_bits``) and unpacked a slice of rows at a time."""
    # The Function sees 2-D rows: its output is then a tensor of its own, not a view, so model
    # code may modify it in place (HF Wav2Vec2 does); the reshape outside is tracked as usual.
    y, scales = _MaskedQuantLinear.apply(x.reshape(-1, x.shape[-1]), w, b, mask, channel_wise, transposed)
    return y.reshape(*x.shape[:-1], y.shape[-1]), scales
