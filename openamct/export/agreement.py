"""How two models' outputs agree over a set of inputs, in figures that mean something at any
batch size: the cosine of each sample's output, the largest difference relative to the
output's range, and top-1 agreement, with the differing rows that are near-ties counted.

A single row compared at batch 1 is all or nothing ("argmax agreement 0 %" next to a cosine of
0.99998): a row whose two best scores are closer than the two models' usual difference can go
either way, and says nothing about the deploy model. Such rows are counted as near-ties: top-2
margin under twice the median over rows of each row's largest difference (the usual rounding
noise; a flip of a decisive row is not one, docs/dev/numeric-tests.md).
"""

from __future__ import annotations

import numpy as np

__all__ = ["compare_outputs"]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / denom) if denom > 0 else float(np.array_equal(a, b))


def compare_outputs(ref: list[np.ndarray], other: list[np.ndarray]) -> dict:
    """``ref`` and ``other``: one output of two models, one array per input sample, alike in
    shape. Returns ``cosine_min`` / ``cosine_mean`` (per sample), ``max_abs_diff``,
    ``rel_diff`` (max |diff| over the reference's range), and for outputs whose last axis holds
    scores (two or more dimensions, more than one score): ``rows``, ``same_top1``,
    ``near_ties`` (differing rows whose reference top-2 margin is under twice the median row's
    largest difference)."""
    if len(ref) != len(other) or not ref:
        raise ValueError(f"ref and other: expected the same non-zero number of samples, got {len(ref)} and {len(other)}")
    cos, max_abs, lo, hi = [], 0.0, np.inf, -np.inf
    for a, b in zip(ref, other, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"output shapes differ: {list(a.shape)} vs {list(b.shape)}")
        a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        cos.append(_cosine(a64, b64))
        if a64.size:
            max_abs = max(max_abs, float(np.max(np.abs(a64 - b64))))
            lo, hi = min(lo, float(a64.min())), max(hi, float(a64.max()))
    span = hi - lo if hi > lo else 0.0
    out = {"samples": len(ref), "cosine_min": min(cos), "cosine_mean": float(np.mean(cos)),
           "max_abs_diff": max_abs, "rel_diff": max_abs / span if span > 0 else (0.0 if max_abs == 0 else float("inf")),
           "rows": None, "same_top1": None, "near_ties": None}
    first = ref[0]
    if first.ndim >= 2 and first.shape[-1] > 1 and np.issubdtype(first.dtype, np.floating):
        ra = np.concatenate([a.reshape(-1, a.shape[-1]) for a in ref]).astype(np.float64)
        rb = np.concatenate([b.reshape(-1, b.shape[-1]) for b in other]).astype(np.float64)
        same = ra.argmax(1) == rb.argmax(1)
        top2 = np.sort(ra, axis=1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        noise = float(np.median(np.abs(ra - rb).max(1)))
        out.update(rows=int(len(ra)), same_top1=int(same.sum()),
                   near_ties=int(np.sum(~same & (margin < 2 * noise))))
    return out
