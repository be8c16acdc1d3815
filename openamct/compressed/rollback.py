"""Undo what a failed forward did to a compressed model's state (issue 16).

A forward that raises (a batch of the wrong shape) must not initialise activation clips from
that batch, advance the 2:4 step counters or move the output ranges. The record keeper takes a
``ForwardSnapshot`` before each forward and drops it when the forward returns; a snapshot still
there at the next forward, at ``state_dict()`` or at save belongs to a forward that raised, and
is put back. Only what a forward changes is kept: uninitialised clips, step counters, and a
mask only when this forward is due to recompute it.
"""

from __future__ import annotations

from torch import nn

from openamct.prune.nm import NMSparsifier
from openamct.quant.quantizers import ActULQ, RangeObserver

_ALL_KEPT = object()  # a snapshot's mask: the all-kept one a sparsifier starts with
_ACT = ("clip_max", "clip_min", "initialized", "init_batches", "init_range", "init_clip_sum")


def _take(m: nn.Module, training: bool):
    if isinstance(m, ActULQ):
        if bool(m.initialized):
            return None
        return {k: getattr(m, k).detach().clone() for k in _ACT}, m._init_last_input
    if isinstance(m, NMSparsifier):
        due = not m._ready or (training and m.update_freq > 0 and m._step % m.update_freq == 0)
        # Packed: a copy costs an eighth of a byte per weight (issue 19). A mask not computed
        # yet is all kept, which is put back without a copy: in the first step at 1.1B the
        # copies were 130 MB of new pages, 0.55 s on these VMs.
        mask = None
        if due:
            mask = _ALL_KEPT if not m._ready and m.holds_all_kept() else m.mask_bits.clone()
        return m._step, m._ready, m.step.clone(), m.mask_ready.clone(), m._changes.clone(), mask
    if isinstance(m, RangeObserver) and training:
        return m.min_val.clone(), m.max_val.clone(), m.initialized.clone()
    return None


def _put(m: nn.Module, state) -> None:
    if isinstance(m, ActULQ):
        tensors, last = state
        for k, v in tensors.items():
            getattr(m, k).data.copy_(v)
        m._init_last_input = last
    elif isinstance(m, NMSparsifier):
        m._step, m._ready, step, ready, changes, mask = state
        m.step.copy_(step)
        m.mask_ready.copy_(ready)
        m._changes.copy_(changes)
        if mask is _ALL_KEPT:
            m.reset_all_kept()
        elif mask is not None:
            m.mask_bits.copy_(mask)
    elif isinstance(m, RangeObserver):
        for buf, v in zip((m.min_val, m.max_val, m.initialized), state, strict=True):
            buf.copy_(v)


class ForwardSnapshot:
    def __init__(self, layers: dict[str, nn.Module], training: bool) -> None:
        self.items, seen = [], set()
        self.masks_due = False  # whether this forward may write a mask (and restore would write one back)
        for layer in layers.values():
            for m in (layer.act_quant, layer.sparsity, layer.out_observer):
                if m is None or id(m) in seen:
                    continue
                seen.add(id(m))
                state = _take(m, training)
                if state is not None:
                    self.items.append((m, state))
                    self.masks_due |= m is layer.sparsity and state[-1] is not None

    def restore(self) -> None:
        for m, state in self.items:
            _put(m, state)
