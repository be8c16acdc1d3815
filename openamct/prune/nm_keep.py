"""Which weights each 2:4 group keeps: the comparisons behind ``nm.compute_nm_mask`` and the
sparsifier's recompute (the rule and its tie order are in ``nm.py``'s docstring)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from openamct._workspace import Workspace

__all__ = ["nm_keep_flags", "keep24_into"]


@torch.no_grad()
def nm_keep_flags(weight: Tensor, axis: int, n: int, m: int, groups: int) -> Tensor:
    """Bool keep-flags of ``nm.compute_nm_mask`` for any n:m, axis and conv groups (arguments
    already validated); a new tensor. Bool, not a float mask: allocating a fresh float mask
    costs more than the comparisons themselves (first-touch page faults)."""
    mag = torch.nan_to_num_(weight.detach().abs(), nan=float("inf"))
    channels = weight.shape[axis]
    per_group = channels // groups
    padded = -(-per_group // m) * m
    mag = mag.unflatten(axis, (groups, per_group))
    if padded != per_group:
        # -1 is below every real magnitude (>= 0): padding always loses.
        pad_shape = list(mag.shape)
        pad_shape[axis + 1] = padded - per_group
        mag = torch.cat([mag, mag.new_full(pad_shape, -1.0)], dim=axis + 1)
    mag = mag.unflatten(axis + 1, (padded // m, m))
    keep = torch.stack(_keep_flags(mag.unbind(axis + 2), n), dim=axis + 2)
    keep = keep.flatten(axis + 1, axis + 2).narrow(axis + 1, 0, per_group)
    return keep.flatten(axis, axis + 1)


def _keep_flags(pos: Sequence[Tensor], n: int) -> list[Tensor]:
    """Per position of a group: is it among the n largest? ``pos[i] >= pos[j]`` for i < j
    means i outranks j (a tie goes to the lower index); keep iff it outranks >= m - n others."""
    m = len(pos)
    if (n, m) == (2, 4):
        def fresh(_name: str) -> Tensor:
            return torch.empty(pos[0].shape, dtype=torch.bool, device=pos[0].device)

        out = [fresh("") for _ in range(4)]
        _vote24(pos, out, fresh)
        return out
    beats = {(i, j): pos[i] >= pos[j] for i in range(m) for j in range(i + 1, m)}
    wins = [torch.zeros_like(pos[0], dtype=torch.uint8) for _ in range(m)]
    for (i, j), i_wins in beats.items():
        wins[i] += i_wins
        wins[j] += ~i_wins
    return [w >= (m - n) for w in wins]


def keep24_into(x: Tensor, axis: int, ws: Workspace) -> Tensor:
    """:func:`nm_keep_flags` for 2:4 when ``x.shape[axis]`` is a multiple of 4 (no padding), with
    every temporary in ``ws``: the result is a view of a workspace buffer, valid until the
    next call. The same majority votes as ``_keep_flags`` (``_vote24``), written straight into
    the result's four positions, so a mask recompute allocates nothing per slice (issue 19: at 1.1B
    parameters the fresh |w| and bool planes of each 4 MB slice took 1.4 of the 2.4 s the first
    step spent on masks)."""
    shape, dev = x.shape, x.device
    mag = torch.abs(x, out=ws.take("mag", shape, x.dtype, dev)).nan_to_num_(nan=float("inf"))
    groups = mag.unflatten(axis, (shape[axis] // 4, 4))
    pos = groups.unbind(axis + 1)
    keep = ws.take("keep", groups.shape, torch.bool, dev)
    _vote24(pos, keep.unbind(axis + 1), lambda name: ws.take(name, pos[0].shape, torch.bool, dev))
    return keep.flatten(axis, axis + 1)


def _vote24(pos: Sequence[Tensor], out: Sequence[Tensor], buf: Callable[[str], Tensor]) -> None:
    """2:4 keep-flags of the four positions ``pos`` into ``out``; ``buf(name)`` gives a bool
    temporary of a position's shape. Outranking >= 2 of the 3 others is a majority vote: bool
    ops on bytes, ~1.4x faster than counting wins in uint8."""
    b01, b02, b03, b12, b13, b23 = (torch.ge(pos[i], pos[j], out=buf(f"b{i}{j}"))
                                    for i, j in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)))
    both, either = buf("both"), buf("either")

    def maj(a: Tensor, b: Tensor, c: Tensor, into: Tensor) -> Tensor:
        torch.bitwise_and(a, b, out=both)
        torch.bitwise_or(a, b, out=either).bitwise_and_(c)
        return torch.bitwise_or(both, either, out=into)

    def neg(b: Tensor, name: str) -> Tensor:
        return torch.bitwise_not(b, out=buf(name))

    maj(b01, b02, b03, out[0])
    maj(neg(b01, "n01"), b12, b13, out[1])
    maj(neg(b02, "n02"), neg(b12, "n12"), b23, out[2])
    maj(b03, b13, b23, out[3]).bitwise_not_()
