"""The training step of a compressed Linear (2:4 mask and/or ARQ weights, no BN) as one
autograd Function that never holds the effective weight E = q(w * mask) per layer.

Why: the composed path allocates two weight-sized tensors per layer per step (the
masked weight, then the fake-quantized one that ``F.linear`` keeps for backward). Above glibc's
mmap threshold (32 MB at most: a 2048x5632 Linear is 46 MB) every such allocation is a fresh
mapping, so each step page-faults and zeroes them again; at 1.1B parameters that made the QAT
step 3.5x a plain FP32 step, and the kept copy held a second float copy of every weight for the
whole backward. Here forward builds E from the weight, mask and scales, and backward builds it
again (five cheap passes) for the input gradient:
- for a few input rows (``SLICED_MAX_ROWS``, the usual fine-tuning batch of tokens), a slice of
  E's rows at a time in a 4 MB buffer, multiplied while it is in cache (``_sliced_product``);
- for more rows, whole, in one scratch tensor per thread as large as the largest layer.
So training holds no per-layer copy, and a step maps no new weight pages.

Numerics: E and the scales are bit-identical to ``_MaskSTE`` -> ``ARQWeightFunction``'s (the
same ops in the same order), and so, with E whole, are outputs and gradients (tests). Sliced
products differ from one matmul with E only in the summation order (a few ulps).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.autograd import Function

if TYPE_CHECKING:  # runtime.py calls this module's forward: imported where a fresh runtime is made
    from openamct.large.runtime import LargeRuntime

from openamct.formats import INT8_WEIGHT
from openamct.large.mask_bits import unpack_rows_reused
from openamct.large.workspace import Workspace
from openamct.quant.functions import SCALE_EPS, _absmax_per_channel, _bshape, graph_mode
from openamct.record.mask_codec import unpack_rows
from openamct.sparsity.nm import apply_mask

# The buffers live in the model's ``LargeRuntime`` (runtime.py), passed in as ``rt``: ``rt.scratch``
# (one effective weight per thread, as large as the largest layer, and the slices) and ``rt.grads``
# (weight gradients, written where the last step's freed .grad was; E's grid values wait there from
# a forward to its backward when it is free).


_CHUNK_ELEMS = 1 << 20  # 4 MB of float32 per slice: it stays in cache across the passes on it

# Up to this many rows of input (tokens), a product with the effective weight runs a slice of
# its rows at a time, each multiplied as soon as it is built (``_sliced_product``): the weight
# is then read from memory once, as a plain matmul reads it, instead of read, written whole to
# the scratch (4.4 GB per pass at 1.1B parameters) and read back. Measured on 2 EPYC cores, a
# 5632x2048 Linear's forward: 64 rows 18.7 -> 14.5 ms (plain F.linear 12.2), 256 rows 43.0 ->
# 41.6 ms; at 1024 rows slices are slower (131 -> 158 ms): the matmul is then bound by
# arithmetic, and small ones pack the input again.
SLICED_MAX_ROWS = 256


def _row_step(w: Tensor) -> int:
    return max(1, _CHUNK_ELEMS // max(1, w[0].numel())) if w.shape[0] else 1


def _row_slices(w: Tensor):
    rows, step = w.shape[0], _row_step(w)
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def _effective(w: Tensor, mask: Tensor | None, channel_wise: bool | None, axis: int,
               out: Tensor, scales: Tensor | None = None, codes: Tensor | None = None,
               ws: Workspace | None = None, qmax: int = INT8_WEIGHT.qmax) -> Tensor | None:
    """Write mask(w) (``mask``: packed, ``mask_bits``' layout), fake-quantized when
    ``channel_wise`` is not None, into ``out`` (its int8 grid values into ``codes`` if given);
    return the ARQ scales (max|w|/``qmax``, the weight format's; output channels on ``axis``,
    or 1 element; computed unless given) or None.

    A slice of rows at a time: the mask, the scales' reduction and the three
    quantize passes then run on 4 MB that stays in cache, instead of six trips through memory
    over the whole weight. Every element gets the same ops as on the whole tensor (a max is
    exact in any order), so the result is bit-identical."""
    if _whole_scales_needed(channel_wise, axis, scales):  # the masked weight waits in ``out``
        scales = _scales_over_rows(w, mask, channel_wise, axis, lambda rows: out[rows], ws, qmax)
        for rows in _row_slices(w):
            _quantize_(out[rows], _scales_of(scales, rows, channel_wise, axis), channel_wise, axis,
                       None if codes is None else codes[rows])
        return scales
    return _each_slice(w, mask, channel_wise, axis, scales, lambda rows: out[rows], codes=codes, ws=ws, qmax=qmax)


def _whole_scales_needed(channel_wise: bool | None, axis: int, scales: Tensor | None) -> bool:
    """Scales over all rows (per tensor, or per column of HF's Conv1D layout) not yet known."""
    return channel_wise is not None and scales is None and not (channel_wise and axis == 0)


def _scales_over_rows(w: Tensor, mask: Tensor | None, channel_wise: bool, axis: int, view,
                      ws: Workspace | None = None, qmax: int = INT8_WEIGHT.qmax) -> Tensor:
    """ARQ scales reduced over every row of mask(w), each slice masked into ``view(rows)``."""
    amax = None
    for rows in _row_slices(w):
        o = _masked_into(w, mask, rows, view(rows), ws)
        part = _absmax_per_channel(o, axis) if channel_wise else torch.maximum(o.amax(), o.amin().neg()).reshape(1)
        amax = part if amax is None else torch.maximum(amax, part)
    return (amax.float() / qmax).clamp_(min=SCALE_EPS)


def _each_slice(w: Tensor, mask: Tensor | None, channel_wise: bool | None, axis: int,
                scales: Tensor | None, view, then=None, codes: Tensor | None = None,
                ws: Workspace | None = None, qmax: int = INT8_WEIGHT.qmax) -> Tensor | None:
    """Build each slice of rows of the effective weight in ``view(rows)`` (per-row scales
    computed as it goes, other scales given; grid values into ``codes``), then call
    ``then(rows, slice)``; the scales."""
    per_row = channel_wise and axis == 0 and scales is None  # each slice holds whole channels
    if per_row:
        scales = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for rows in _row_slices(w):
        o = _masked_into(w, mask, rows, view(rows), ws)
        if channel_wise is not None:
            if per_row:
                scales[rows] = (_absmax_per_channel(o, 0).float() / qmax).clamp_(min=SCALE_EPS)
            _quantize_(o, _scales_of(scales, rows, channel_wise, axis), channel_wise, axis,
                       None if codes is None else codes[rows])
        if then is not None:
            then(rows, o)
    return scales


def _scales_of(scales: Tensor, rows: slice, channel_wise: bool, axis: int) -> Tensor:
    return scales[rows] if channel_wise and axis == 0 else scales


class _SlicedMM:
    """``lhs @ E`` (``reduce``) or ``lhs @ E.T``, from slices of E's rows as they are built:
    its rows are a block of the result's columns, or with ``reduce`` a part of the sum,
    accumulated in a result small enough to stay in cache."""

    def __init__(self, lhs: Tensor, shape: torch.Size, reduce: bool) -> None:
        self.lhs, self.reduce = lhs, reduce
        cols = math.prod(shape[1:]) if reduce else shape[0]
        empty = reduce and not shape[0]  # a sum of nothing
        self.out = lhs.new_zeros(lhs.shape[0], cols) if empty else lhs.new_empty(lhs.shape[0], cols)

    def add(self, rows: slice, o: Tensor) -> None:
        lhs, o2 = self.lhs, o.reshape(o.shape[0], -1)
        if not self.reduce:
            # A block of columns has unit stride along its rows: BLAS writes it in place (the
            # result of an lm_head's slices was a transposed copy, 11 ms of a 60M step).
            torch.mm(lhs, o2.t(), out=self.out[:, rows])
        elif rows.start == 0:
            torch.mm(lhs[:, rows], o2, out=self.out)
        else:
            self.out.addmm_(lhs[:, rows], o2)


def _slice_view(like: Tensor, dtype: torch.dtype, ws: Workspace):
    """``view(rows)``: the scratch's slice buffer, shaped for rows ``rows`` of ``like``."""
    step = min(like.shape[0], _row_step(like))
    buf = ws.take("slice", (step, *like.shape[1:]), dtype, like.device)
    return lambda rows: buf[: rows.stop - rows.start]


def _sliced_product(w: Tensor, mask: Tensor | None, channel_wise: bool | None, axis: int,
                    lhs: Tensor, scales: Tensor | None = None, *, reduce: bool,
                    codes: Tensor | None = None, ws: Workspace, qmax: int = INT8_WEIGHT.qmax
                    ) -> tuple[Tensor, Tensor | None]:
    """(a fresh contiguous ``lhs @ E`` when ``reduce``, else ``lhs @ E.T``; the ARQ scales or
    None), E the effective weight in ``w``'s layout (``_effective``'s). Each slice of E's rows
    is built in a small buffer and multiplied at once, so E never exists whole (see
    ``SLICED_MAX_ROWS``).

    The same values as the product with the whole E up to the matmul's summation order, which
    smaller products block differently (a few ulps; the scales are bit-identical)."""
    view = _slice_view(w, w.dtype, ws)
    if _whole_scales_needed(channel_wise, axis, scales):
        scales = _scales_over_rows(w, mask, channel_wise, axis, view, ws, qmax)
    mm = _SlicedMM(lhs, w.shape, reduce)
    scales = _each_slice(w, mask, channel_wise, axis, scales, view, mm.add, codes, ws, qmax)
    return mm.out, scales


def _masked_into(w: Tensor, bits: Tensor | None, rows: slice, out: Tensor, ws: Workspace | None = None) -> Tensor:
    """Rows ``rows`` of ``w * mask`` into ``out``, the mask's rows unpacked into ``ws`` (or new
    memory without one)."""
    if bits is None:
        return out.copy_(w[rows])
    if ws is None:
        return apply_mask(w[rows], unpack_rows(bits, w.shape, rows), out)
    return apply_mask(w[rows], unpack_rows_reused(bits, w.shape, rows, ws), out)


def _broadcast(scales: Tensor, o: Tensor, channel_wise: bool, axis: int) -> Tensor:
    return scales.reshape(_bshape(o.dim(), axis)) if channel_wise else scales.reshape(())


def _quantize_(o: Tensor, scales: Tensor, channel_wise: bool, axis: int, codes: Tensor | None = None) -> None:
    """Fake-quantize ``o`` in place; its integer grid values also into ``codes`` (int8)."""
    s = _broadcast(scales, o, channel_wise, axis)
    o.mul_(s.reciprocal()).round_()
    if codes is not None:
        codes.copy_(o)
    o.mul_(s)


def _dequantize_into(codes: Tensor, scales: Tensor, channel_wise: bool, axis: int, o: Tensor) -> Tensor:
    """``_quantize_``'s result again from its codes: the same last multiply of the same values,
    so the same bits."""
    return o.copy_(codes).mul_(_broadcast(scales, o, channel_wise, axis))


class _MaskedQuantLinear(Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, mask: Tensor | None,
                channel_wise: bool | None, transposed: bool, rt, qmax: int = INT8_WEIGHT.qmax):
        # The input gradient needs E again. Rebuilt from w it costs the forward's mask, scales
        # and quantize passes once more (11 ops a slice: on a 512x512 Linear with 64 rows, 0.65
        # ms beside a 0.48 ms matmul); from E's int8 grid values kept here, one cast and one
        # multiply. They take a quarter of the weight's bytes until the backward: in the weight
        # gradient's buffer when that is free (grad_pool.py), which the backward fills after it
        # has read them, so they cost no memory of their own; otherwise a buffer of their own
        # (a pool of such buffers saved under 10 % of a 60M step's time and peak: dropped).
        codes = None
        ctx.codes_in_grad = False
        if channel_wise is not None and ctx.needs_input_grad[0]:
            codes = rt.grads.codes_for(w)  # None unless w requires grad and its buffer is free
            ctx.codes_in_grad = codes is not None
            if codes is None:
                codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        with torch.no_grad():
            y, scales = _product(x, w, mask, channel_wise, int(transposed), reduce=transposed, b=b, codes=codes,
                                 ws=rt.scratch, qmax=qmax)
        ctx.save_for_backward(x, w, mask, scales, codes)
        ctx.meta = (channel_wise, transposed, b is not None)
        ctx.rt = rt
        if scales is not None:
            ctx.mark_non_differentiable(scales)
        return y, scales

    @staticmethod
    def backward(ctx, g: Tensor, _gs):
        x, w, mask, scales, codes = ctx.saved_tensors
        if ctx.codes_in_grad and getattr(ctx, "codes_read", False):
            codes = None  # a second backward (retain_graph): the first wrote the gradient over them
        ctx.codes_read = True
        channel_wise, transposed, has_bias = ctx.meta
        rt = ctx.rt
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        if need_x:  # g @ E (E.T when stored transposed): E's rows are summed over, or g's columns
            if codes is not None:
                # A channel whose scale is not finite (a weight that is not finite, whose codes
                # int8 cannot hold) is all NaN in E, as rebuilding E from w makes it: its scale
                # becomes NaN (a select, no host read of the scales).
                scales = scales.where(scales.isfinite(), float("nan"))
                gx = _dequantized_product(g, codes, scales, channel_wise, int(transposed), w.dtype,
                                          reduce=not transposed, ws=rt.scratch)
            else:  # no codes
                gx = _product(g, w, mask, channel_wise, int(transposed), reduce=not transposed, scales=scales,
                              ws=rt.scratch)[0]
        if need_w:  # straight through the mask and the quantizer (docs/dev/reference.md, Algorithms)
            lhs, rhs = (x.t(), g) if transposed else (g.t(), x)
            out = rt.grads.out_for(w, g, codes if ctx.codes_in_grad else None)  # gx has read them
            gw = lhs.mm(rhs) if out is None else rt.grads.handed(torch.mm(lhs, rhs, out=out))
        if need_b and has_bias:
            gb = g.sum(0)
        return gx, gw, gb, None, None, None, None, None


def _product(lhs: Tensor, w: Tensor, mask: Tensor | None, channel_wise: bool | None, axis: int, *,
             reduce: bool, scales: Tensor | None = None, b: Tensor | None = None,
             codes: Tensor | None = None, ws: Workspace, qmax: int = INT8_WEIGHT.qmax
             ) -> tuple[Tensor, Tensor | None]:
    """(``lhs @ E`` when ``reduce``, else ``lhs @ E.T``, plus ``b``; the ARQ scales or None) for
    2-D ``lhs``, E's int8 grid values into ``codes`` if given: E's rows a slice at a time for
    few rows of ``lhs``, else E built whole in the shared scratch (``F.linear``, as the
    composed path multiplies)."""
    if lhs.shape[0] <= SLICED_MAX_ROWS:
        y, scales = _sliced_product(w, mask, channel_wise, axis, lhs, scales, reduce=reduce, codes=codes, ws=ws,
                                    qmax=qmax)
        return (y if b is None else y.add_(b)), scales
    weff = ws.take_like("weight", w)
    scales = _effective(w, mask, channel_wise, axis, weff, scales, codes, ws, qmax)
    return torch.nn.functional.linear(lhs, weff.t() if reduce else weff, b), scales


def _dequantized_product(lhs: Tensor, codes: Tensor, scales: Tensor, channel_wise: bool, axis: int,
                         dtype: torch.dtype, *, reduce: bool, ws: Workspace) -> Tensor:
    """``_product`` with E from the grid values a forward kept (the same E, bit for bit)."""
    if lhs.shape[0] <= SLICED_MAX_ROWS:
        view = _slice_view(codes, dtype, ws)
        mm = _SlicedMM(lhs, codes.shape, reduce)
        for rows in _row_slices(codes):
            mm.add(rows, _dequantize_into(codes[rows], _scales_of(scales, rows, channel_wise, axis),
                                          channel_wise, axis, view(rows)))
        return mm.out
    weff = ws.take("weight", codes.shape, dtype, codes.device)
    for rows in _row_slices(codes):
        _dequantize_into(codes[rows], _scales_of(scales, rows, channel_wise, axis), channel_wise, axis, weff[rows])
    return torch.nn.functional.linear(lhs, weff.t() if reduce else weff)


@torch.no_grad()
def eval_linear(x: Tensor, w: Tensor, mask: Tensor | None, channel_wise: bool | None, transposed: bool,
                rt: LargeRuntime | None = None, qmax: int = INT8_WEIGHT.qmax) -> tuple[Tensor, Tensor | None]:
    """(the eval forward without its bias, the ARQ scales or None), the effective weight built
    as in a training step: eval otherwise allocated two or three new weight-sized tensors per
    layer, which above glibc's mmap threshold are fresh pages every forward (at 1.1B parameters
    most of the eval forward's time). The caller adds the bias, which on the int32
    grid depends on the scales."""
    rt = _fresh_runtime() if rt is None else rt
    y, scales = _product(x.reshape(-1, x.shape[-1]), w.detach(), mask, channel_wise, int(transposed),
                         reduce=transposed, ws=rt.scratch, qmax=qmax)
    return y.reshape(*x.shape[:-1], y.shape[-1]), scales


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 has no device argument
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()
    except RuntimeError:  # a device type autocast does not know (meta): never on there
        return False


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
                        channel_wise: bool | None, transposed: bool, rt: LargeRuntime | None = None,
                        qmax: int = INT8_WEIGHT.qmax) -> tuple[Tensor, Tensor | None]:
    """(y, ARQ scales or None): ``F.linear(x, q(w * mask), b)`` (``w.t()`` when
    ``transposed``, HF Conv1D's layout) with straight-through gradients for ``w``; ``mask`` is
    packed (``NMSparsifier.mask_bits``) and unpacked a slice of rows at a time. ``rt``: the
    runtime whose buffers it reuses (a fresh one, used for this call only, when None)."""
    # The Function sees 2-D rows: its output is then a tensor of its own, not a view, so model
    # code may modify it in place (HF Wav2Vec2 does); the reshape outside is tracked as usual.
    rt = _fresh_runtime() if rt is None else rt
    y, scales = _MaskedQuantLinear.apply(x.reshape(-1, x.shape[-1]), w, b, mask, channel_wise, transposed, rt, qmax)
    return y.reshape(*x.shape[:-1], y.shape[-1]), scales


# -- the layer forward's branch point (compressed/layer.py) -------------------------------------
def _fresh_runtime() -> LargeRuntime:
    """A runtime for one call (the functions' callers without a model's runtime: tests)."""
    from openamct.large.runtime import LargeRuntime

    return LargeRuntime()


def takes_large_path(layer, x: Tensor) -> bool:
    """Whether ``layer`` (a CompressedLayer) computes ``x`` here: a CPU input and weight, a
    runtime attached at build (CPU models only), a Linear whose weight path is only a 2:4 mask
    and/or ARQ, and an eager float forward (training with autograd, or eval without)."""
    w = layer.weight
    if getattr(layer, "large", None) is None or x.device.type != "cpu" or w.device.type != "cpu":
        return False
    if (layer.sparsity is None and layer.wts_quant is None) or not layer.plain_weight_path():
        return False
    return fused_ok(x, w) if layer.training else eval_ok(x, w)


def large_forward(layer, x: Tensor) -> Tensor:
    """``layer``'s output for ``x`` (``takes_large_path``): a training step with no weight-sized
    allocation, or an eval forward built as a training step builds E (within a few ulps of the
    plain ``effective_weight_bias`` product)."""
    w, q, rt = layer.weight, layer.wts_quant, layer.large
    mask = None if layer.sparsity is None else layer.sparsity.current_bits(w)
    channel_wise = None if q is None else q.channel_wise
    qmax = INT8_WEIGHT.qmax if q is None else q.format.qmax
    if layer.training:
        y, scales = masked_quant_linear(x, w, layer.bias, mask, channel_wise, layer.kind == "linear_t", rt, qmax)
        layer._saw_scales(scales)
        return y
    y, scales = eval_linear(x, w, mask, channel_wise, layer.kind == "linear_t", rt, qmax)
    b = layer.bias
    if q is not None and b is not None:
        b = layer._bias_on_int32_grid(w, b, scales)
    layer._saw_scales(scales)
    return y if b is None else y.add_(b)
