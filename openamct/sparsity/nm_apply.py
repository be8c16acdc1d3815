"""Multiplying a weight by its n:m mask: dense (``apply_mask``), packed a slice of rows at a time
(``apply_bits``), and the straight-through gradient both train with (``masked_ste``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from openamct.quant.functions import graph_mode
from openamct.record.mask_codec import unpack_bits, unpack_rows

__all__ = ["apply_mask", "apply_bits", "masked_ste", "row_slices"]

_MASK_CHUNK_ELEMS = 1 << 20  # weights per slice of a mask recompute (4 MB of |w|)


def apply_mask(w: Tensor, mask: Tensor, out: Tensor | None = None) -> Tensor:
    """``w * mask`` (bit for bit, -0.0 and NaN included), into ``out`` when given. A bool mask
    is first widened into the result buffer: torch multiplies a float tensor by a bool one
    through a float copy of the mask, 4x slower than this on a 46 MB weight. While a
    graph is captured it is the plain ``Mul`` the exported model should hold."""
    if graph_mode():
        return w * mask
    if out is None:
        out = torch.empty_like(w, memory_format=torch.contiguous_format)
    if mask.dtype == torch.bool:
        return out.copy_(mask.view(torch.uint8)).mul_(w)
    return torch.mul(w, mask, out=out)


def row_slices(shape: Sequence[int], unit: int = 1) -> list[slice]:
    """Slices along dim 0 of about ``_MASK_CHUNK_ELEMS`` elements each, a multiple of ``unit``
    rows (but the last): small enough that a slice's temporaries stay in cache and are reused
    from the heap."""
    rows = int(shape[0]) if len(shape) else 0
    per_row = max(1, math.prod(shape[1:]))
    step = max(unit, _MASK_CHUNK_ELEMS // per_row // unit * unit)
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def apply_bits(w: Tensor, bits: Tensor, out: Tensor | None = None) -> Tensor:
    """``w * mask`` for a packed mask (``mask_bits``), a slice of rows at a time: no full-size
    bool mask is unpacked. While a graph is captured it is the plain ``Mul`` of the whole mask."""
    if graph_mode():
        return w * unpack_bits(bits, 0, w.numel()).view(w.shape)
    if out is None:
        out = torch.empty_like(w, memory_format=torch.contiguous_format)
    for rows in row_slices(w.shape):
        apply_mask(w[rows], unpack_rows(bits, w.shape, rows), out[rows])
    return out


class _MaskSTE(torch.autograd.Function):
    """Forward ``w * mask`` (``mask``: the dense mask, or the packed bits with ``apply``);
    backward passes the gradient to every weight, masked or not (upstream: "gradients reach all
    weights"), so a later recompute can revive pruned weights. Cheaper than
    ``w + (w * mask - w).detach()``: one kernel forward, none backward."""

    @staticmethod
    def forward(ctx, w: Tensor, mask: Tensor, apply=torch.mul) -> Tensor:
        return apply(w, mask)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad, None, None


def masked_ste(w: Tensor, mask: Tensor, apply=torch.mul) -> Tensor:
    """``apply(w, mask)`` (= w * mask), with the straight-through gradient when autograd records."""
    if torch.is_grad_enabled() and w.requires_grad:
        return _MaskSTE.apply(w, mask, apply)
    return apply(w, mask)


