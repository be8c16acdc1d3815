"""Undo what a failed forward did to a compressed model's state.

A forward that raises (a batch of the wrong shape) must not initialise activation clips from
that batch, advance the 2:4 step counters or move the output ranges. The record keeper takes a
``ForwardSnapshot`` before each forward and drops it when the forward returns; a snapshot still
there at the next forward, at ``state_dict()`` or at save belongs to a forward that raised, and
is put back.

What it covers is every module a technique put in the model that a forward may change
(``stateful_modules``): each compressed layer's parts (its children: folded BatchNorm, input,
weight and output quantizers, output observer, 2:4 sparsifier, extra masks, whatever a
technique added), the quantizers of the SiLU/Sigmoid wrappers and those of the residual output
hooks, and the model's own BatchNorms. Only what this forward can change is kept:

- clones, only in the forwards that can change the state they copy: quantizers still
  initialising (an initialised ULQ clip moves only with the optimizer), a 2:4 mask when this
  forward is due to recompute it, a first output range, extra masks in training;
- every training forward moves the BatchNorms' running statistics and the output observers'
  ranges: those small tensors are copied into buffers kept from step to step (``SteadyCopy``,
  one ``torch.cat`` per dtype: no allocation, no clone);
- host counters (a sparsifier's step count) as numbers.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from openamct.quant.activation import QuantizedActivation
from openamct.quant.matmul import MatMulQuant
from openamct.quant.quantizers import ActULQ, RangeObserver, WeightULQ, forget_host_flags, host_flag
from openamct.quant.residual import OutputQuantHook
from openamct.sparsity.nm import NMSparsifier

__all__ = ["ForwardSnapshot", "SteadyCopy", "stateful_modules"]

_ALL_KEPT = object()  # a snapshot's mask: the all-kept one a sparsifier starts with


def stateful_modules(model: nn.Module | None, layers: dict[str, nn.Module]) -> list[tuple[nn.Module, bool]]:
    """(module, is an extra mask) for every module of ``layers`` (name -> CompressedLayer) and
    ``model`` that a forward may change, each once (a quantizer may be shared)."""
    found: dict[int, tuple[nn.Module, bool]] = {}
    for layer in layers.values():
        masks = set(getattr(layer, "mask_names", ()))
        for name, m in layer.named_children():
            found.setdefault(id(m), (m, name in masks))
    for m in model.modules() if model is not None else ():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):  # the model's own: a failed forward's batch
            found.setdefault(id(m), (m, False))  # must not enter its running statistics either
        if isinstance(m, (QuantizedActivation, MatMulQuant)):
            for q in m.quantizers().values():
                found.setdefault(id(q), (q, False))
        for hook in m._forward_hooks.values():
            if isinstance(hook, OutputQuantHook):
                found.setdefault(id(hook.quantizer), (hook.quantizer, False))
    return list(found.values())


def _tensors(m: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t, t.detach().clone()) for t in itertools.chain(m.parameters(), m.buffers())]


class SteadyCopy:
    """A copy of the small tensors every training forward changes, in one flat buffer per
    (dtype, device) that is reused from step to step: ``take`` is one ``torch.cat`` per buffer."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    @torch.no_grad()
    def take(self, tensors: list[torch.Tensor]) -> None:
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for key in list(self._bufs):
            if key not in groups:
                del self._bufs[key]
        for key, ts in groups.items():
            size = sum(t.numel() for t in ts)
            kept = self._bufs.get(key)
            buf = kept[0] if kept is not None and kept[0].numel() == size else torch.empty(size, dtype=key[0],
                                                                                         device=key[1])
            torch.cat([t.reshape(-1) for t in ts], out=buf)
            self._bufs[key] = (buf, ts)

    @torch.no_grad()
    def put(self) -> None:
        for buf, ts in self._bufs.values():
            for t, v in zip(ts, buf.split([t.numel() for t in ts]), strict=True):
                t.copy_(v.view(t.shape))


def _take(m: nn.Module, training: bool, mask: bool, steady: list[torch.Tensor]):
    """What to keep of ``m`` for this forward: a state for ``_put``, or None; tensors that every
    training forward changes go to ``steady`` instead."""
    if isinstance(m, (ActULQ, WeightULQ)):
        if m.is_initialized:  # host copy: no device read per quantizer per step
            return None
        return _tensors(m), getattr(m, "_init_last_input", None)
    if isinstance(m, NMSparsifier):
        due = not m._ready or (training and m.update_freq > 0 and m._step % m.update_freq == 0)
        if not due:
            return (m._step, m._unsynced), m._ready, None
        # Packed: a copy costs an eighth of a byte per weight. A mask not computed
        # yet is all kept, which is put back without a copy: in the first step at 1.1B the
        # copies were 130 MB of new pages, 0.55 s on a 2-core EPYC.
        bits = _ALL_KEPT if not m._ready and m.holds_all_kept() else m.mask_bits.clone()
        return (m._step, m._unsynced), m._ready, (m.mask_ready.clone(), m._changes.clone(), m.step.clone(), bits)
    if isinstance(m, nn.modules.batchnorm._BatchNorm):  # running statistics, in its own training mode
        if m.training and m.track_running_stats and m.running_mean is not None:
            steady.extend((m.running_mean, m.running_var, m.num_batches_tracked))
        return None
    if isinstance(m, RangeObserver):  # updated in training only
        if not training:
            return None
        if not host_flag(m, "initialized"):
            return _tensors(m)
        steady.extend((m.min_val, m.max_val))
        return None
    if mask:  # updated in training only (LayerParts.masks: "may")
        return _tensors(m) if training else None
    return _tensors(m) or None


@torch.no_grad()
def _put(m: nn.Module, state) -> None:
    if isinstance(m, NMSparsifier):
        (m._step, m._unsynced), m._ready, tensors = state
        if tensors is None:
            return
        ready, changes, step, mask = tensors
        m.mask_ready.copy_(ready)
        m._changes.copy_(changes)
        m.step.copy_(step)
        m._installs += 1  # ``version`` reads the counter put back
        if mask is _ALL_KEPT:
            m.reset_all_kept()
        elif mask is not None:
            m.mask_bits.copy_(mask)
        return
    if isinstance(m, (ActULQ, WeightULQ)):
        state, last = state
        if isinstance(m, ActULQ):
            m._init_last_input, m._last = last, None  # no output cached from the failed forward
    for t, v in state:
        if t.shape == v.shape:
            t.copy_(v)
        else:  # WeightULQ's first init gives its scale the weight's channel count
            t.data = v
    forget_host_flags(m)  # a compiled forward reads the host copies without a version check


class ForwardSnapshot:
    """What one forward may change of ``modules`` (``stateful_modules``'s pairs), taken before it."""

    def __init__(self, modules: list[tuple[nn.Module, bool]], training: bool,
                 steady: SteadyCopy | None = None) -> None:
        self.items = []
        self.masks_due = False  # whether this forward may write a mask (and restore would write one back)
        tensors: list[torch.Tensor] = []
        for m, mask in modules:
            state = _take(m, training, mask, tensors)
            if state is not None:
                self.items.append((m, state))
                self.masks_due |= isinstance(m, NMSparsifier) and state[-1] is not None
        self.steady = None
        if tensors:
            self.steady = steady if steady is not None else SteadyCopy()
            self.steady.take(tensors)

    def restore(self) -> None:
        if self.steady is not None:
            self.steady.put()
        for m, state in self.items:
            _put(m, state)
