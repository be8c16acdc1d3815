"""Data-driven initialisation of ULQ activation clips (upstream's IFMR, docs/dev/reference.md).

Upstream: take a percentile max/min of the batch (0.999999, so the true extremes for batches
under a million values), then try clip_max = k * max for k = 0.70, 0.71, ..., 1.30 and keep the
one whose fake-quantized batch has the smallest MSE. At upstream's percentile one outlier in a
normal-sized batch (1e6 among N(0, 1) values) becomes the clip, and every ordinary value then
quantizes to one level. openamct's percentile therefore ignores a handful of extreme values on
each side at every batch size: the larger of upstream's share (1e-6 of the values) and
min(8, n // 1024) values, and warns when what it ignored lies far outside the rest. Under
1024 values it ignores up to n // 64 values on each side, and only those far beyond the rest. Then it runs upstream's MSE search from there: it evaluates all
candidates at once (chunked, exact on the data, not on a histogram), scores them with the real
ULQ quantizer of the activation format (INT8, offset included) and, unless clip_min is fixed at 0, then searches clip_min the
same way with the chosen clip_max (one coordinate-descent round). The search runs once per layer
on at most ``MAX_SEARCH_ELEMS`` evenly strided values of the batch, which bounds its cost; the
stride is coprime with the last dim, so every channel is in the sample.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from openamct.formats import INT8_ACT, QuantFormat
from openamct.quant.functions import SCALE_EPS

logger = logging.getLogger(__name__)

__all__ = ["ignored_count", "percentile_max_min", "search_clips", "grid_align", "init_clips", "MAX_SEARCH_ELEMS"]

MAX_SEARCH_ELEMS = 1 << 18
_PERCENTILE = 0.999999
_HANDFUL = 8  # extreme values ignored on each side (at most n // _PER of them)
_PER = 1024  # one ignored value per this many: small tensors keep their true extremes
_BLOCKS = 1024  # blocks whose maxima bound the top values from below (_extremes)
_FAR = 4.0  # ignored values beyond _FAR x the kept extreme get a warning
_SMALL_MIN = 64  # under 1024 values: one value in this many may be an isolated outlier
_FAR_SMALL = 16.0  # ... when it lies this far beyond the rest (a Gaussian's 9th largest of 768 is 2.4 sigma)
_RATIOS = (0.7, 1.3, 61)  # start, end, count: 0.01 steps, both ends included
_CHUNK_ELEMS = 1 << 20  # candidates x values per chunk: 4 MB of float32 stays in cache across the eight passes (6x faster than 16 MB, measured)


def ignored_count(n: int, percentile: float = _PERCENTILE) -> int:
    """How many of the most extreme of ``n`` values one side of the percentile ignores: the
    larger of upstream's share (1e-6 of the values) and a handful (8, at most n // 1024)."""
    upstream = 0 if 1.0 - percentile < 1e-7 else max(0, n - int(percentile * n) - 1)
    return max(upstream, min(_HANDFUL, n // _PER))


def _extremes(flat: Tensor, k: int, largest: bool) -> Tensor:
    """``torch.topk(flat, k, largest).values``, exactly, without sorting every value: on CPU a
    topk of a 131k-value batch took 3.4 ms, a third of a layer's clip initialisation.
    The k-th largest of the maxima of ``_BLOCKS`` blocks bounds the k-th largest value from
    below (k distinct values reach it), so only values at or above it can be among the top k."""
    n = flat.numel()
    if n < _BLOCKS * 64 or k > _BLOCKS:
        return torch.topk(flat, k, largest=largest).values
    blocks = flat[:n - n % _BLOCKS].view(_BLOCKS, -1)
    ends = blocks.amax(dim=1) if largest else blocks.amin(dim=1)
    if bool(torch.isnan(ends).any()):  # topk ranks NaN above everything; a comparison drops it
        return torch.topk(flat, k, largest=largest).values
    bound = torch.topk(ends, k, largest=largest).values[-1]
    near = flat[flat >= bound] if largest else flat[flat <= bound]
    return torch.topk(near, k, largest=largest).values


def percentile_max_min(x: Tensor, max_percentile: float = _PERCENTILE,
                       min_percentile: float = _PERCENTILE) -> tuple[float, float]:
    """Percentile extremes that ignore the ``ignored_count`` most extreme values on each side,
    clamped so that max >= 0 >= min."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    if n == 0:
        raise ValueError("percentile_max_min: empty tensor")
    k_max = min(n, ignored_count(n, max_percentile) + 1)
    k_min = min(n, ignored_count(n, min_percentile) + 1)
    if k_max == k_min == 1 and n >= _SMALL_MIN:
        return _small_max_min(flat)
    top = _extremes(flat, k_max, largest=True)
    bottom = _extremes(flat, k_min, largest=False)
    hi, lo = float(top[-1]), float(bottom[-1])
    far_hi = int((top[:-1] > _FAR * max(abs(hi), abs(lo), 1e-12)).sum())
    far_lo = int((bottom[:-1] < -_FAR * max(abs(hi), abs(lo), 1e-12)).sum())
    if far_hi or far_lo:
        logger.warning("activation clip init: %d of %d values lie far outside the rest (%.6g .. %.6g, the "
                       "rest within [%.6g, %.6g]); treated as outliers and ignored for the clip range",
                       far_hi + far_lo, n, float(bottom[0]), float(top[0]), lo, hi)
    return max(hi, 0.0), min(lo, 0.0)


def _small_max_min(flat: Tensor) -> tuple[float, float]:
    """The extremes of a tensor too small for the fixed handful (under 1024 values: a small
    first batch, a tabular model's input): up to n // 64 of the most extreme values on each side
    are ignored only when they lie far (``_FAR_SMALL`` x) beyond the rest's extreme, so an
    isolated outlier is dropped at any size while ordinary data keeps its true extremes."""
    n = flat.numel()
    k = min(_HANDFUL, n // _SMALL_MIN)
    top = torch.topk(flat, k + 1).values
    bottom = torch.topk(flat, k + 1, largest=False).values
    ref = max(abs(float(top[k])), abs(float(bottom[k])))
    far_hi = int((top[:k] > _FAR_SMALL * ref).sum()) if ref > 0 else 0
    far_lo = int((bottom[:k] < -_FAR_SMALL * ref).sum()) if ref > 0 else 0
    hi, lo = float(top[far_hi]), float(bottom[far_lo])
    if far_hi or far_lo:
        logger.warning("activation clip init: %d of %d values lie far outside the rest (%.6g .. %.6g, the "
                       "rest within [%.6g, %.6g]); treated as outliers and ignored for the clip range",
                       far_hi + far_lo, n, float(bottom[0]), float(top[0]), lo, hi)
    return max(hi, 0.0), min(lo, 0.0)


def _mse(x: Tensor, cmax: Tensor, cmin: Tensor, fmt: QuantFormat = INT8_ACT) -> Tensor:
    """MSE of the ULQ quantizer of ``fmt`` for each (cmax[i], cmin[i]) pair on values x."""
    qmin, qmax = fmt.qmin, fmt.qmax
    scale = ((cmax - cmin) / fmt.levels).clamp(min=SCALE_EPS)
    zp = torch.round(qmin - cmin / scale).clamp(qmin, qmax)
    # (round(x/s) + z).clamp(qmin, qmax) - z is round(x/s) clamped to [qmin - z, qmax - z], bit
    # for bit (integers, exact in float32; a value past the bounds lands on them either way):
    # two broadcast passes instead of three (clamp with tensor bounds is a scalar loop).
    lo, hi = (qmin - zp)[:, None], (qmax - zp)[:, None]
    # One chunk buffer for the whole call, rounded in place: two fresh tensors per chunk cost
    # more than the arithmetic (2x on a 65k-value batch).
    out = torch.empty_like(scale)
    step = max(1, _CHUNK_ELEMS // max(1, x.numel()))
    buf = torch.empty((min(step, scale.numel()), x.numel()), dtype=x.dtype, device=x.device)
    for i in range(0, scale.numel(), step):
        s = scale[i:i + step, None]
        q = torch.div(x[None, :], s, out=buf[:s.shape[0]]).round_()
        torch.maximum(q, lo[i:i + step], out=q)
        torch.minimum(q, hi[i:i + step], out=q).mul_(s)
        out[i:i + step] = q.sub_(x[None, :]).square_().mean(dim=1)
    return out


def _stride(n: int, last: int) -> int:
    """A stride that keeps at most MAX_SEARCH_ELEMS of n values and visits every index of the
    last dim: one sharing a factor with it skips whole channels (stride 2 on a [tokens, 1024]
    activation keeps the even channels only), and an LLM's outliers live in a few channels."""
    stride = -(-n // MAX_SEARCH_ELEMS)
    while math.gcd(stride, last) != 1:
        stride += 1
    return stride


def _subsample(x: Tensor) -> Tensor:
    flat = x.detach().reshape(-1).float()
    if flat.numel() > MAX_SEARCH_ELEMS:
        stride = _stride(flat.numel(), x.shape[-1] if x.dim() else 1)
        # Contiguous: the search reads it 122 times, 3x slower strided (measured).
        flat = flat[::stride].contiguous()
    return flat


def search_clips(x: Tensor, max_val: float, min_val: float, fixed_min: bool,
                 fmt: QuantFormat = INT8_ACT) -> tuple[float, float]:
    """MSE search of clip_max over [0.7, 1.3] x max_val, then of clip_min likewise (not fixed)."""
    flat = _subsample(x)
    ratios = torch.linspace(*_RATIOS, dtype=torch.float32, device=flat.device)
    min_val = 0.0 if fixed_min else min_val
    cmax_c = ratios * max_val
    cmin_c = torch.full_like(cmax_c, min_val)
    best_max = float(cmax_c[torch.argmin(_mse(flat, cmax_c, cmin_c, fmt))])
    best_min = min_val
    if not fixed_min and min_val < 0.0:
        cmin_c = ratios * min_val
        best_min = float(cmin_c[torch.argmin(_mse(flat, torch.full_like(cmin_c, best_max), cmin_c, fmt))])
    return best_max, best_min


def grid_align(cmax: float, cmin: float, fmt: QuantFormat = INT8_ACT) -> tuple[float, float]:
    """Snap clips to the levels they produce, as upstream stores them: (qmax-o)s, (qmin-o)s
    (INT8: (127-o)s, (-128-o)s)."""
    qmin, qmax = fmt.qmin, fmt.qmax
    s = max((cmax - cmin) / fmt.levels, SCALE_EPS)
    o = min(max(round(qmin - cmin / s), qmin), qmax)
    return (qmax - o) * s, (qmin - o) * s


def init_clips(x: Tensor, fixed_min: bool, running: tuple[float, float] | None = None,
               fmt: QuantFormat = INT8_ACT) -> tuple[tuple[float, float], tuple[float, float]]:
    """One initialisation batch: returns ((clip_max, clip_min), (max, min)) where (max, min) are
    the percentile extremes merged with ``running`` (earlier batches) that the search started from."""
    hi, lo = percentile_max_min(x)
    if running is not None:
        hi, lo = max(hi, running[0]), min(lo, running[1])
    if fixed_min:
        lo = 0.0
    if hi - lo <= SCALE_EPS:
        logger.warning("ActULQ clip init: the batch has no spread (all values %.6g); using clip "
                       "range [%.6g, %.6g]", hi, lo, lo + 1.0)
        return (lo + 1.0, lo), (hi, lo)
    cmax, cmin = search_clips(x, hi, lo, fixed_min, fmt)
    return grid_align(cmax, cmin, fmt), (hi, lo)
