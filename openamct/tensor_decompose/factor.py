"""One convolution split into two (spatial SVD, upstream AMCT's scheme).

A K_h x K_w conv W[o, i, h, w] becomes a conv along one kernel axis into ``rank`` channels
followed by a conv along the other axis: W[o, i, h, w] ~ sum_r F[r, i, h] * G[o, r, w]
("vertical first": F is K_h x 1, G is 1 x K_w) or the mirror ("horizontal first"). The
unfolded weight (rows: the first conv's input channel and kernel axis; columns: the output
channel and the other axis) is factored by a truncated SVD in float64; the factors are cast
back to the weight's dtype. At full rank the pair computes the original conv (to rounding).

The side with fewer channels takes the shorter kernel axis (upstream's four modes): the
orthonormal SVD factor goes to that side, the singular values to the other. Stride and
padding of each axis go with the conv that runs along it; the bias goes to the second conv.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openamct.tensor_decompose.rank import choose_rank

__all__ = ["MODES", "mode_of", "vertical_first", "split_weight", "build_pair", "decompose_conv", "singular_values"]

# Upstream's names: First/Second Channel (the first conv's input or the last conv's output is
# the narrow side) and First/Second Kernel (the short kernel axis is the height or the width).
MODES = ("FCFK", "FCSK", "SCFK", "SCSK")


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[-1]))


def mode_of(conv: nn.Conv2d) -> str:
    kh, kw = _pair(conv.kernel_size)
    return ("FC" if conv.out_channels < conv.in_channels else "SC") + ("FK" if kh <= kw else "SK")


def vertical_first(mode: str) -> bool:
    """True when the first conv of ``mode`` runs along the height (K_h x 1)."""
    return mode in ("SCFK", "FCSK")


def _matrix(weight: torch.Tensor, vertical: bool) -> torch.Tensor:
    o, i, kh, kw = weight.shape
    if vertical:  # rows (i, h), columns (o, w)
        return weight.permute(1, 2, 0, 3).reshape(i * kh, o * kw)
    return weight.permute(1, 3, 0, 2).reshape(i * kw, o * kh)  # rows (i, w), columns (o, h)


def singular_values(conv: nn.Conv2d) -> torch.Tensor:
    """The unfolded weight's singular values (float64, descending)."""
    w = conv.weight.detach().to("cpu", torch.float64)
    return torch.linalg.svdvals(_matrix(w, vertical_first(mode_of(conv))))


def split_weight(conv: nn.Conv2d, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """The two conv weights (float64) of ``conv`` at ``rank`` (None: upstream's rule), the rank,
    and the relative Frobenius error of the product against the weight."""
    w = conv.weight.detach().to("cpu", torch.float64)
    o, i, kh, kw = w.shape
    mode = mode_of(conv)
    vertical = vertical_first(mode)
    mat = _matrix(w, vertical)
    u, s, vh = torch.linalg.svd(mat, full_matrices=False)
    if rank is None:
        rank = choose_rank(s.numpy(), conv)
    if not 1 <= rank <= s.numel():
        raise ValueError(f"rank {rank} is outside 1..{s.numel()} for a conv of weight shape {tuple(w.shape)}")
    u, s, vh = u[:, :rank], s[:rank], vh[:rank]
    if mode.startswith("SC"):  # the first conv's input is the narrow side: it gets U
        first, second = u.T, s[:, None] * vh
    else:
        first, second = (u * s).T, vh
    k1, k2 = (kh, kw) if vertical else (kw, kh)
    f = first.reshape(rank, i, k1)
    g = second.reshape(rank, o, k2).permute(1, 0, 2)
    if vertical:
        f, g = f[..., None], g[:, :, None, :]
    else:
        f, g = f[:, :, None, :], g[..., None]
    total = float(torch.linalg.matrix_norm(mat))
    rest = float(torch.linalg.matrix_norm(mat - (first.T @ second))) if total else 0.0
    return f.contiguous(), g.contiguous(), rank, (rest / total if total else 0.0)


def _axis_split(value, vertical: bool, other):
    """(first, second) values of a per-axis attribute: each conv keeps its own axis's value
    and takes ``other`` on the axis it does not run along."""
    h, w = _pair(value)
    return ((h, other), (other, w)) if vertical else ((other, w), (h, other))


def build_pair(conv: nn.Conv2d, mode: str, rank: int, device=None) -> nn.Sequential:
    """The two convs that replace ``conv`` (structure only: the weights are nn.Conv2d's default
    initialisation, or uninitialised with ``device="meta"``)."""
    vertical = vertical_first(mode)
    kh, kw = _pair(conv.kernel_size)
    stride = _axis_split(conv.stride, vertical, 1)
    if isinstance(conv.padding, str):
        padding = (conv.padding, conv.padding)
    else:
        padding = _axis_split(conv.padding, vertical, 0)
    k1, k2 = ((kh, 1), (1, kw)) if vertical else ((1, kw), (kh, 1))
    kw_args = {"dtype": conv.weight.dtype, "device": device if device is not None else conv.weight.device}
    first = nn.Conv2d(conv.in_channels, rank, k1, stride=stride[0], padding=padding[0], bias=False,
                      padding_mode=conv.padding_mode, **kw_args)
    second = nn.Conv2d(rank, conv.out_channels, k2, stride=stride[1], padding=padding[1],
                       bias=conv.bias is not None, padding_mode=conv.padding_mode, **kw_args)
    seq = nn.Sequential(first, second)
    seq.train(conv.training)
    return seq


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` (float64) as ``ref``'s dtype (clamped to its range), device and memory format."""
    if ref.dtype != torch.float64:
        info = torch.finfo(ref.dtype)
        t = t.clamp(info.min, info.max)
    t = t.to(device=ref.device, dtype=ref.dtype)
    if not ref.is_contiguous() and ref.is_contiguous(memory_format=torch.channels_last):
        t = t.contiguous(memory_format=torch.channels_last)
    return t


def decompose_conv(conv: nn.Conv2d, rank: int | None = None) -> tuple[nn.Sequential, float]:
    """The decomposed pair with its weights set, and the relative weight error. ``conv`` is
    read, never changed."""
    f, g, rank, err = split_weight(conv, rank)
    seq = build_pair(conv, mode_of(conv), rank, device="meta")
    grad = conv.weight.requires_grad
    seq[0].weight = nn.Parameter(_like(f, conv.weight), requires_grad=grad)
    seq[1].weight = nn.Parameter(_like(g, conv.weight), requires_grad=grad)
    if conv.bias is not None:
        seq[1].bias = nn.Parameter(conv.bias.detach().clone(), requires_grad=conv.bias.requires_grad)
    if not math.isfinite(err):
        raise ValueError("the decomposition is not finite: the weight holds NaN/inf values")
    return seq, err
