"""N:M (2:4) structured sparsity: mask computation and the training-time sparsifier module.

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

from openamct.prune.nm_keep import _check_int, compute_nm_mask, nm_keep_flags
from openamct.prune.nm_layers import nm_axis, nm_eligible, nm_groups
from openamct.quant.functions import graph_mode
from openamct.record.mask_codec import pack_bits, packed_size, unpack_bits, unpack_rows, write_bits

logger = logging.getLogger(__name__)

__all__ = ["nm_axis", "nm_groups", "compute_nm_mask", "nm_eligible", "apply_mask", "apply_bits", "NMSparsifier"]

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
    """Forward ``w * mask``; backward passes the gradient to every weight, masked or not
    (SPEC: "gradients reach all weights"), so a later recompute can revive pruned weights.
    Cheaper than ``w + (w * mask - w).detach()``: one kernel forward, none backward."""

    @staticmethod
    def forward(ctx, w: Tensor, bits: Tensor) -> Tensor:
        return apply_bits(w, bits)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class NMSparsifier(nn.Module):
    """Applies a 2:4 mask to a weight: ``forward(w) -> w * mask``.

    State (all in the state_dict): ``mask_bits`` (uint8, the mask packed one bit per weight in
    the record's bit order, see ``mask_bits.py``: an eighth of a byte per weight;
    checkpoints with a bool or float 0/1 ``mask`` of the weight's shape still load),
    ``mask_ready`` (bool), ``step`` (int64, training forwards seen). ``mask`` reads the whole
    mask as bool (a new tensor). In training mode the mask is computed from ``w`` on the first
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
        groups: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
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
        self._ready = False
        self._step = 0
        # The 2:4 recompute's branch point (``_keep_of``): ``keep24(axis)`` -> a keep-flags
        # function for one recompute, set by build on a CPU model (openamct.large); None: the
        # plain ``nm_keep_flags``.
        self.keep24 = None
        self._installs = 0  # masks installed/loaded/put back: ``version`` reads ``_changes`` after one
        self._version_read = (-1, 0)

    @classmethod
    def from_module(cls, module: nn.Module, update_freq: int) -> NMSparsifier:
        """Sparsifier matching ``module``'s weight (shape, axis, groups, dtype, device);
        ``ValueError`` with the reason when the module is not eligible."""
        ok, reason = nm_eligible(module)
        if not ok:
            raise ValueError(f"module: not eligible for 2:4 sparsity: {reason}")
        w = module.weight
        return cls(tuple(w.shape), nm_axis(module), update_freq, groups=nm_groups(module),
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
        return (f"weight_shape={list(self.weight_shape)}, axis={self.axis}, "
                f"update_freq={self.update_freq}, groups={self.groups}")

    def forward(self, w: Tensor) -> Tensor:
        bits = self.current_bits(w)
        if torch.is_grad_enabled() and w.requires_grad and not graph_mode():
            return _MaskSTE.apply(w, bits)
        return apply_bits(w, bits)

    def apply_installed(self, w: Tensor) -> Tensor:
        """``w * mask`` with the mask as it is: no batch counted, no recompute."""
        return apply_bits(w, self.mask_bits)

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
            # No recompute can be due: only the device counter moves. The host count schedules
            # recomputes alone, and a compiled forward must not read it (the compiler would guard
            # on its value and recompile at every step).
            self.step.add_(1)
            if not torch.compiler.is_compiling():
                self._step += 1
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
            self.step.fill_(self._step)
        elif not self._ready:
            self._recompute(w)

    def _pieces(self) -> tuple[list[slice], int]:
        """Row slices a recompute may compute on their own, and the ``groups`` to compute each
        with. Each (but the last) holds a multiple of 8 weights, so it owns whole bytes of
        ``mask_bits``; on a transposed layout (2:4 groups run along dim 0) a multiple of 4
        rows, so no 2:4 group is cut, unless conv groups pad on their own (one piece then)."""
        shape = self.weight_shape
        per_row = math.prod(shape[1:])
        unit = 8 // math.gcd(per_row, 8) if per_row else 1
        if self.axis == 0:
            if self.groups > 1 and (shape[0] // self.groups) % 4:
                return [slice(0, shape[0])], self.groups
            unit = math.lcm(unit, 4)
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
        keep_of = _keep_of(w, self.axis, groups, self.keep24)
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
        self._installs += 1


def _keep_of(w: Tensor, axis: int, groups: int, keep24=None):
    """A slice's 2:4 keep-flags for a recompute of ``w``. Branch point: with ``keep24`` (the
    sparsifier's, set on CPU models), a CPU weight and no 2:4 group padded or cut by a conv
    group, ``keep24(axis)`` (in one workspace made for this recompute, no fresh temporaries per
    slice); otherwise the plain ``nm_keep_flags``."""
    if keep24 is not None and w.device.type == "cpu" and w.shape[axis] % (4 * groups) == 0:
        return keep24(axis)
    return lambda x: nm_keep_flags(x, axis, 2, 4, groups)


def _all_kept(numel: int, device) -> Tensor:
    """Packed all-ones mask of ``numel`` weights; the last byte's unused bits stay zero."""
    bits = torch.full((packed_size(numel),), 0xFF, dtype=torch.uint8, device=device)
    if numel % 8:
        bits[-1] = _last_kept_byte(numel)
    return bits


def _last_kept_byte(numel: int) -> int:
    return (0xFF << (8 - numel % 8)) & 0xFF if numel % 8 else 0xFF
