"""Which convolutions upstream AMCT decomposes, and at which rank.

Eligibility (upstream's README, "decomposition constraints", and its filter): a plain
``nn.Conv2d`` with groups 1, dilation 1, both strides at most 2, both kernel sides at least 3,
and big enough that a split pays: (short kernel side x smaller channel count) at least 16, and
either a kernel of 7 or more or at least 64 channels on the narrow side. So a 3x3 conv needs
64+ input and output channels; a 7x7 stem qualifies with 3 input channels.

Rank: the weight is unfolded into an L x M matrix (L = short kernel side x fewer channels,
M = long kernel side x more channels). Empirical variational Bayesian matrix factorisation
(EVBMF: Nakajima et al., "Global analytic solution of fully-observed variational Bayesian
matrix factorization", JMLR 2013) estimates the noise level of its singular values and keeps
those above the resulting threshold. That estimate is then held within [L // (d + 1), L // d]
(d = 6, or 4 when both channel counts are 256 or more), rounded to a multiple of 16 (at least
16, one step up when rounding lost more than a tenth), and capped at L.
"""

from __future__ import annotations

import math

import numpy as np
from torch import nn

__all__ = ["ineligible_reason", "choose_rank", "evbmf_rank", "matrix_sides"]

_STEP = 16  # ranks are multiples of this (hardware-friendly channel counts)


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[-1]))


def matrix_sides(conv: nn.Conv2d) -> tuple[int, int]:
    """(L, M) of the unfolded weight: short kernel side x fewer channels, and the rest."""
    kh, kw = _pair(conv.kernel_size)
    c_small, c_big = sorted((conv.in_channels, conv.out_channels))
    return min(kh, kw) * c_small, max(kh, kw) * c_big


def ineligible_reason(conv: nn.Module) -> str | None:
    """None when upstream's rule decomposes ``conv``; else why not (one phrase per kind of
    reason, with no layer names or numbers, so that alike layers share one log line)."""
    if type(conv) is not nn.Conv2d:
        return "a subclass of nn.Conv2d (only convs built by torch.nn.Conv2d() are decomposed)"
    if not conv.weight.is_floating_point():
        return "its weight is not a floating-point tensor"
    if conv.weight.is_meta:
        return "its weight is on the meta device"
    if getattr(conv, "parametrizations", None):
        return "its weight is parametrized (torch.nn.utils.parametrize)"
    if conv.groups != 1:
        return "grouped or depthwise (groups > 1)"
    if _pair(conv.dilation) != (1, 1):
        return "dilated (dilation > 1)"
    kh, kw = _pair(conv.kernel_size)
    if min(kh, kw) < 3:
        return "a kernel side below 3 (1x1 and 1xK convs have nothing to split)"
    if max(_pair(conv.stride)) > 2:
        return "a stride above 2"
    c_small = min(conv.in_channels, conv.out_channels)
    if min(kh, kw) * c_small < _STEP:
        return "too small (short kernel side x fewer channels below 16)"
    if min(kh, kw) < 7 and c_small < 64:
        return "fewer than 64 input or output channels with a kernel below 7x7 (the split would not pay)"
    return None


def _tau(x: np.ndarray, alpha: float) -> np.ndarray:
    b = x - (1.0 + alpha)
    return 0.5 * (b + np.sqrt(np.maximum(b * b - 4.0 * alpha, 0.0)))


def _free_energy(sigma2: float, s: np.ndarray, m: int, alpha: float, x_bar: float) -> float:
    """EVBMF's objective in the noise variance (the paper's Omega, up to constants): every
    singular value pays x - log x; those above the threshold x_bar earn back the log-evidence
    of a nonzero component."""
    x = s * s / (m * sigma2)
    big = x > x_bar
    t = _tau(x[big], alpha)
    return float(np.sum(x - np.log(x)) + np.sum(np.log(t + 1.0) + alpha * np.log(t / alpha + 1.0) - t))


def _minimise(f, lo: float, hi: float, iters: int = 200) -> float:
    """Golden-section search for the minimum of ``f`` on [lo, hi], in log space (the noise
    variance of conv weights spans many decades)."""
    a, b = math.log(lo), math.log(hi)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(iters):
        if b - a < 1e-9:
            break
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(math.exp(d))
    return math.exp((a + b) / 2.0)


def evbmf_rank(s: np.ndarray, l_side: int, m_side: int) -> int:
    """How many of the singular values ``s`` (descending, ``l_side`` of them, of an
    l_side x m_side matrix, l_side <= m_side) EVBMF judges to be signal rather than noise."""
    s = np.asarray(s, dtype=np.float64)[:l_side]
    if s.size == 0 or not np.any(s > 0):
        return 0
    alpha = l_side / m_side
    tau_bar = 2.5129 * math.sqrt(alpha)  # the paper's constant: where the VB solution turns nonzero
    x_bar = (1.0 + tau_bar) * (1.0 + alpha / tau_bar)
    upper = float(np.sum(s * s)) / (l_side * m_side)
    h_ub = min(math.ceil(l_side / (1.0 + alpha)) - 1, s.size) - 1
    tail = s[h_ub + 1:] if h_ub + 1 < s.size else s[-1:]
    lower = max(float(s[min(h_ub + 1, s.size - 1)]) ** 2 / (m_side * x_bar), float(np.mean(tail * tail)) / m_side)
    lower = max(lower, upper * 1e-12, np.finfo(np.float64).tiny)
    sigma2 = upper if lower >= upper else _minimise(lambda v: _free_energy(v, s, m_side, alpha, x_bar), lower, upper)
    threshold = math.sqrt(m_side * sigma2 * x_bar)
    return int(np.sum(s > threshold))


def choose_rank(s: np.ndarray, conv: nn.Conv2d) -> int:
    """Upstream's rank for ``conv`` from its unfolded weight's singular values ``s``."""
    l_side, m_side = matrix_sides(conv)
    est = evbmf_rank(s, l_side, m_side)
    d = 4 if min(conv.in_channels, conv.out_channels) >= 256 else 6
    est = max(min(est, l_side // d), l_side // (d + 1))
    rank = max(_STEP, (est + _STEP // 2) // _STEP * _STEP)
    if rank < 0.9 * est:
        rank += _STEP
    return max(1, min(rank, len(s)))
