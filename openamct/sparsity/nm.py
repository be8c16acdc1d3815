"""N:M structured sparsity (upstream's 2:4, any n of m here): mask computation and the
training-time sparsifier module.

Upstream AMCT's ``l1_selective_prune`` (docs/dev/reference.md, Algorithms): along the weight's input-channel
axis, every group of ``m`` consecutive weights (same output channel and kernel position) keeps
its ``n`` largest magnitudes. The axis is zero-padded to a multiple of ``m`` and padding always
counts as smaller than any real weight: the rule is exactly "keep the n largest of the m padded
entries", so with 2:4 a trailing group of 3 real weights keeps 2 of them, of 2 keeps both, of 1
keeps it (Cin = 6 keeps 4 of 6 per row, Cin = 3 keeps 2 of 3).

Tie rule (deterministic, independent of device and thread count): among equal magnitudes the
entry with the lower index along the axis (the earlier input channel) is kept. NaN magnitudes
rank as +inf, so a diverged weight stays visible instead of being silently masked.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from openamct.quant.functions import graph_mode
from openamct.record.mask_codec import pack_bits, packed_size, unpack_bits, write_bits
from openamct.sparsity.nm_apply import apply_bits, apply_mask, masked_ste, row_slices
from openamct.sparsity.nm_keep import _check_int, compute_nm_mask, nm_keep_flags
from openamct.sparsity.nm_layers import nm_axis, nm_eligible, nm_groups

logger = logging.getLogger(__name__)

__all__ = ["nm_axis", "nm_groups", "compute_nm_mask", "nm_eligible", "apply_mask", "apply_bits", "masked_ste",
           "NMSparsifier"]

class NMSparsifier(nn.Module):
    """Applies an n:m mask (2:4 unless told) to a weight: ``forward(w) -> w * mask``.

    State (all in the state_dict): ``mask_bits`` (uint8, the mask packed one bit per weight in
    the record's bit order, see ``mask_bits.py``: an eighth of a byte per weight;
    checkpoints with a bool or float 0/1 ``mask`` of the weight's shape still load),
    ``mask_ready`` (bool), ``step`` (int64, training forwards seen; counted on the host and
    written into the buffer when a state dict is taken). ``mask`` reads the whole mask as bool
    (a new tensor). The forward multiplies by the mask unpacked once per change into the
    weight's dtype (``dense_mask``): one op a step. In training mode the mask is computed from ``w`` on the first
    forward and, with ``update_freq`` > 0, recomputed whenever ``step % update_freq == 0``;
    ``update_freq == 0`` keeps the first mask. Eval mode never recomputes a ready mask; an
    unready one is computed once so eval works, and it then counts as the first-batch mask
    (same weights unless the caller changed them in between).

    With autograd recording, the product is a straight-through estimator: ``d/dw = g``
    unmasked. Without (eval under ``no_grad``, export) it is a plain ``Mul`` with the mask.

    ``version`` counts mask changes (recomputes that changed a bit, ``set_mask``, loads), so the
    record owner knows when to rewrite the record. It is a notification counter, not
    checkpointed state; reading it synchronises with the device.
    """

    def __init__(
        self,
        weight_shape: Sequence[int],
        axis: int,
        update_freq: int,
        *,
        n: int = 2,
        m: int = 4,
        groups: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.n, self.m = _check_int("n", n, 1), _check_int("m", m, 1)
        if n > m:
            raise ValueError(f"n: {n} kept of every m={m} is more than m")
        if isinstance(weight_shape, (str, bytes)) or not isinstance(weight_shape, Sequence):
            raise TypeError(
                f"weight_shape: expected a sequence of ints, got {type(weight_shape).__name__}"
            )
        shape = tuple(_check_int("weight_shape", d, 0) for d in weight_shape)
        if len(shape) < 2:
            raise ValueError(f"weight_shape: need at least 2 dims, got {list(shape)}")
        _check_int("axis", axis, 0)
        if axis >= len(shape):
            raise ValueError(f"axis: {axis} is out of range for weight_shape {list(shape)}")
        self.update_freq = _check_int("update_freq", update_freq, 0)
        self.groups = _check_int("groups", groups, 1)
        if shape[axis] % self.groups:
            raise ValueError(f"groups: {groups} does not divide weight_shape[{axis}]={shape[axis]}")
        self.weight_shape = torch.Size(shape)
        self.axis = axis
        # ``dtype`` (the weight's) is accepted for the callers that pass it; the mask is bits
        # whatever the weight.
        self.register_buffer("mask_bits", _all_kept(math.prod(shape), device))
        self.register_buffer("mask_ready", torch.zeros((), dtype=torch.bool, device=device))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        # Not checkpointed: see `version`. A buffer so it follows .to(device) and is bumped
        # without a host sync.
        self.register_buffer(
            "_changes", torch.zeros((), dtype=torch.int64, device=device), persistent=False
        )
        # Host mirrors of mask_ready/step: reading the buffers every forward would force a
        # device sync per layer per step on accelerators. Refreshed on every state_dict load.
        # Eager forwards are counted on the host (``_step``; ``_unsynced`` of them not yet in
        # ``step``, which a state dict adds: no op per step); a compiled forward counts on the
        # device instead (the compiler would guard on a host count and recompile every step).
        self._ready = False
        self._step = 0
        self._unsynced = 0
        self.register_state_dict_pre_hook(_write_step)
        # Branch points of the large-model machinery (openamct.large), set by build when the
        # model takes it; None keeps the plain path. ``keep24(axis)``: a keep-flags function for
        # one 2:4 recompute (``_keep_of``); ``apply_packed(w, bits)``: ``w * mask`` unpacked a
        # slice of rows at a time, instead of a weight-sized mask kept in memory.
        self.keep24 = None
        self.apply_packed = None
        self._installs = 0  # masks installed/loaded/put back: ``version`` reads ``_changes`` after one
        self._version_read = (-1, 0)

    @classmethod
    def from_module(cls, module: nn.Module, update_freq: int, n: int = 2, m: int = 4) -> NMSparsifier:
        """Sparsifier matching ``module``'s weight (shape, axis, groups, dtype, device);
        ``ValueError`` with the reason when the module is not eligible."""
        ok, reason = nm_eligible(module)
        if not ok:
            raise ValueError(f"module: not eligible for 2:4 sparsity: {reason}")
        w = module.weight
        return cls(tuple(w.shape), nm_axis(module), update_freq, n=n, m=m, groups=nm_groups(module),
                   dtype=w.dtype, device=w.device)

    @property
    def version(self) -> int:
        if self._version_read[0] != self._installs:  # the counter may have moved: read it
            self._version_read = (self._installs, int(self._changes.item()))
        return self._version_read[1]

    @property
    def mask(self) -> Tensor:
        """The whole mask, bool of the weight's shape (True = kept): a new tensor, a byte per
        weight, for callers that need it all at once (records of small models, checks)."""
        return unpack_bits(self.mask_bits, 0, self.weight_shape.numel()).view(self.weight_shape)

    def extra_repr(self) -> str:
        return (f"{self.n}:{self.m}, weight_shape={list(self.weight_shape)}, axis={self.axis}, "
                f"update_freq={self.update_freq}, groups={self.groups}")

    def dense_mask(self, like: Tensor) -> Tensor:
        """The mask in ``like``'s dtype and device, unpacked once per mask change (a recompute,
        a load, a move writes or replaces ``mask_bits``) and kept: derived, not state."""
        bits = self.mask_bits
        if torch.compiler.is_compiling():  # a compiled forward unpacks in its graph (no host cache)
            return unpack_bits(bits, 0, self.weight_shape.numel()).view(self.weight_shape).to(like.dtype)
        key = (bits, bits._version, like.dtype, like.device)
        kept = self.__dict__.get("_dense")
        if kept is None or kept[0][0] is not bits or kept[0][1:] != key[1:]:
            with torch.no_grad():
                mask = unpack_bits(bits, 0, self.weight_shape.numel()).view(self.weight_shape)
                kept = self.__dict__["_dense"] = (key, mask.to(device=like.device, dtype=like.dtype))
        return kept[1]

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_dense", None)  # derived from mask_bits: a copy unpacks its own
        return state

    def forward(self, w: Tensor) -> Tensor:
        bits = self.current_bits(w)
        if graph_mode():
            return apply_bits(w, bits)
        if self.apply_packed is not None:  # branch point: the large-model path (see __init__)
            return masked_ste(w, bits, self.apply_packed)
        return masked_ste(w, self.dense_mask(w))

    def apply_installed(self, w: Tensor) -> Tensor:
        """``w * mask`` with the mask as it is: no batch counted, no recompute."""
        if graph_mode() or self.apply_packed is not None:
            return apply_bits(w, self.mask_bits)
        return torch.mul(w, self.dense_mask(w))

    def current_bits(self, w: Tensor) -> Tensor:
        """What ``forward(w)`` multiplies by (``mask_bits``), after the same bookkeeping (a
        training call counts a batch and may recompute the mask): for callers that apply the
        mask themselves."""
        if not w.is_floating_point():
            raise TypeError(f"w: expected a floating-point weight, got {w.dtype}")
        # Skipped under tracing: the comparison would be baked into the trace as a constant.
        if not torch.jit.is_tracing() and w.shape != self.weight_shape:
            raise ValueError(
                f"w: shape {list(w.shape)} does not match the sparsifier's weight_shape "
                f"{list(self.weight_shape)}"
            )
        if self.training and self._ready and self.update_freq == 0:
            # No recompute can be due: only the count moves (see ``_unsynced``).
            if torch.compiler.is_compiling():
                self.step.add_(1)
            else:
                self._step += 1
                self._unsynced += 1
        elif self.training or not self._ready:
            self._count_batch(w)
        return self.mask_bits

    # Host bookkeeping that decides a recompute: compiled, it runs eagerly (a graph break).
    @torch.compiler.disable
    def _count_batch(self, w: Tensor) -> None:
        if self.training:
            if not self._ready or (self.update_freq > 0 and self._step % self.update_freq == 0):
                self._recompute(w)
            self._step += 1
            self._unsynced += 1
        elif not self._ready:
            self._recompute(w)

    def _pieces(self) -> tuple[list[slice], int]:
        """Row slices a recompute may compute on their own, and the ``groups`` to compute each
        with. Each (but the last) holds a multiple of 8 weights, so it owns whole bytes of
        ``mask_bits``; on a transposed layout (n:m groups run along dim 0) a multiple of m
        rows, so no group is cut, unless conv groups pad on their own (one piece then)."""
        shape = self.weight_shape
        per_row = math.prod(shape[1:])
        unit = 8 // math.gcd(per_row, 8) if per_row else 1
        if self.axis == 0:
            if self.groups > 1 and (shape[0] // self.groups) % self.m:
                return [slice(0, shape[0])], self.groups
            unit = math.lcm(unit, self.m)
            return row_slices(shape, unit), 1
        return row_slices(shape, unit), self.groups

    @torch.no_grad()
    def _recompute(self, w: Tensor) -> None:
        """The mask of ``w``, a slice of rows at a time straight into ``mask_bits``: the
        comparisons' temporaries (a float |w| and six bool planes) then stay small enough to
        be reused from the heap and the cache, instead of mapping several weight-sized tensors
        (at 1.1B parameters the first step spent 7 s page-faulting them)."""
        w = w.detach()
        if w.numel() == 0:
            return self._mark_installed(None)
        pieces, groups = self._pieces()
        per_row = w[0].numel()
        changed = torch.zeros((), dtype=torch.bool, device=self.mask_bits.device)
        keep_of = _keep_of(w, self.axis, groups, self.n, self.m, self.keep24)
        for rows in pieces:
            changed |= write_bits(self.mask_bits, rows.start * per_row, keep_of(w[rows]))
        self._mark_installed(changed)

    def holds_all_kept(self) -> bool:
        """Whether ``mask_bits`` is the all-kept mask a sparsifier starts with (one read, no copy)."""
        bits = self.mask_bits
        if bits.numel() == 0:
            return True
        return int(bits[-1]) == _last_kept_byte(self.weight_shape.numel()) and \
            (bits.numel() == 1 or int(bits[:-1].min()) == 0xFF)

    def reset_all_kept(self) -> None:
        """Write the all-kept mask into ``mask_bits`` in place (what ``holds_all_kept`` saw)."""
        if self.mask_bits.numel():
            with torch.no_grad():
                self.mask_bits.fill_(0xFF)
                self.mask_bits[-1] = _last_kept_byte(self.weight_shape.numel())

    def _mark_installed(self, changed: Tensor | None) -> None:
        self._changes.add_(changed if self._ready and changed is not None else 1)
        self._installs += 1
        self.mask_ready.fill_(True)
        self._ready = True

    def set_mask(self, mask: Tensor) -> None:
        """Install a mask read from a record; it counts as the computed mask (ready)."""
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
        if tuple(mask.shape) != self.weight_shape:
            raise ValueError(
                f"mask: shape {list(mask.shape)} does not match weight shape "
                f"{list(self.weight_shape)}"
            )
        if mask.dtype != torch.bool and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("mask: values must be 0 or 1")
        self.set_mask_bits(pack_bits(mask))

    def set_mask_bits(self, bits: Tensor) -> None:
        """Install a packed mask (``mask_bits``' layout, e.g. a record's words): no unpacking."""
        expected = packed_size(self.weight_shape.numel())
        if bits.dtype != torch.uint8 or tuple(bits.shape) != (expected,):
            raise ValueError(f"bits: expected {expected} uint8 bytes for weight shape {list(self.weight_shape)}, "
                             f"got {bits.dtype} {list(bits.shape)}")
        with torch.no_grad():
            changed = torch.ne(self.mask_bits, bits.to(self.mask_bits.device)).any() if self._ready else None
            self.mask_bits.copy_(bits)
        self._mark_installed(changed)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs) -> None:
        legacy = state_dict.pop(prefix + "mask", None)
        if legacy is not None and prefix + "mask_bits" not in state_dict:
            # A checkpoint from before masks were packed: a bool or float 0/1 mask of the
            # weight's shape (checkpoint.load_into has checked its values).
            if tuple(legacy.shape) != self.weight_shape:
                error_msgs.append(f"size mismatch for {prefix}mask: copying a mask of shape {list(legacy.shape)}, "
                                  f"the weight's is {list(self.weight_shape)}")
                return
            state_dict[prefix + "mask_bits"] = pack_bits(legacy)
        # (A restore loads a part of the checkpoint at a time: the mask may be in another part.)
        old = self.mask_bits.detach().clone() if prefix + "mask_bits" in state_dict else None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        with torch.no_grad():
            if old is not None and self.mask_bits.shape == old.shape and not torch.equal(
                    self.mask_bits, old.to(self.mask_bits)):
                self._changes.add_(1)
        self._ready = bool(self.mask_ready.item())
        self._step = int(self.step.item())
        self._unsynced = 0
        self._installs += 1


def _keep_of(w: Tensor, axis: int, groups: int, n: int, m: int, keep24=None):
    """A slice's n:m keep-flags for a recompute of ``w``. Branch point: for 2:4 with ``keep24``
    (the sparsifier's, set when the model takes the large-model path), a CPU weight and no 2:4
    group padded or cut by a conv group, ``keep24(axis)`` (in one workspace made for this
    recompute, no fresh temporaries per slice); otherwise the plain ``nm_keep_flags``."""
    if (keep24 is not None and (n, m) == (2, 4) and w.device.type == "cpu"
            and w.shape[axis] % (4 * groups) == 0):
        return keep24(axis)
    return lambda x: nm_keep_flags(x, axis, n, m, groups)


def _write_step(module: NMSparsifier, prefix: str, keep_vars: bool) -> None:
    """State-dict pre-hook: the training forwards counted on the host into the ``step`` buffer."""
    if module._unsynced:
        with torch.no_grad():
            module.step.add_(module._unsynced)
        module._unsynced = 0


def _all_kept(numel: int, device) -> Tensor:
    """Packed all-ones mask of ``numel`` weights; the last byte's unused bits stay zero."""
    bits = torch.full((packed_size(numel),), 0xFF, dtype=torch.uint8, device=device)
    if numel % 8:
        bits[-1] = _last_kept_byte(numel)
    return bits


def _last_kept_byte(numel: int) -> int:
    return (0xFF << (8 - numel % 8)) & 0xFF if numel % 8 else 0xFF
