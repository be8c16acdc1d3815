"""2:4 masks at one bit per weight (issue 19).

A bool mask costs a byte per weight: a quarter of a float32 model's weight bytes, held for the
whole life of the compressed model (create, training, save). Packed, it costs an eighth of a
byte. The layout is the record's (``mask_codec``): the weight flattened in C order, element
``i`` at bit ``7 - i % 8`` of byte ``i // 8`` (``numpy.packbits``' default), unused bits of the
last byte zero. So the record's words are these bytes zero-padded to whole 8-byte words, and
a record's words are these bytes with the padding dropped: neither direction unpacks.

Readers unpack a slice of rows at a time (the fused training step, the save's writer), so no
full-size bool mask exists outside a whole-mask read (``NMSparsifier.mask``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from openamct._workspace import Workspace

__all__ = ["packed_size", "pack_bits", "unpack_bits", "unpack_rows", "unpack_rows_reused", "write_bits"]

_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)  # bit of each of a byte's 8 elements
# Byte value -> its 8 flags as one int64 (their bytes in element order): unpacking is then one
# gather into a kept buffer (``unpack_rows_reused``).
_FLAGS_OF_BYTE = torch.from_numpy(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).copy()).view(torch.int64).reshape(256)
_WS = Workspace()


def packed_size(numel: int) -> int:
    return -(-numel // 8)


def pack_bits(keep: Tensor) -> Tensor:
    """Bool (or 0/1) tensor -> uint8 bytes of ``packed_size(keep.numel())``."""
    flat = keep.detach().reshape(-1)
    if flat.dtype != torch.bool:
        flat = flat.ne(0)
    if flat.device.type == "cpu":
        return torch.from_numpy(np.packbits(flat.numpy()))
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = (1 << _SHIFTS.to(torch.int32)).to(device=flat.device, dtype=torch.uint8)
    return (flat.view(-1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(bits: Tensor, start: int, count: int) -> Tensor:
    """Elements ``[start, start + count)`` of a packed mask, as a flat bool tensor."""
    b0, b1 = start // 8, packed_size(start + count)
    chunk = bits[b0:b1]
    if chunk.device.type == "cpu":
        flags = torch.from_numpy(np.unpackbits(chunk.numpy()))
    else:
        flags = (chunk.unsqueeze(-1) >> _SHIFTS.to(chunk.device)).bitwise_and_(1).reshape(-1)
    # view(bool) reinterprets the 0/1 bytes without a copy; a tracer cannot record it on a
    # constant (torch.jit alias analysis asserts), so a captured graph gets a cast instead.
    flags = flags.bool() if torch.jit.is_tracing() else flags.view(torch.bool)
    return flags.narrow(0, start - 8 * b0, count)


def unpack_rows(bits: Tensor, shape: tuple[int, ...] | torch.Size, rows: slice) -> Tensor:
    """Rows ``rows`` (along dim 0) of a packed mask of ``shape``, as bool of their shape."""
    start, count = _elements_of_rows(shape, rows)
    return unpack_bits(bits, start, count).view(rows.stop - rows.start, *shape[1:])


def _elements_of_rows(shape: tuple[int, ...] | torch.Size, rows: slice) -> tuple[int, int]:
    """(first flat element, element count) of rows ``rows`` of a C-order tensor of ``shape``."""
    per_row = math.prod(shape[1:])
    return rows.start * per_row, (rows.stop - rows.start) * per_row


def unpack_rows_reused(bits: Tensor, shape: tuple[int, ...] | torch.Size, rows: slice) -> Tensor:
    """``unpack_rows`` into a buffer kept per thread: valid until the next call on that thread.

    Why: ``np.unpackbits`` returns a new array per call. In a 250M-parameter model's first
    training step its 240 unpacks of ~1 MB took 0.32 s (0.015 s in later steps), fresh memory
    each time; from this buffer the first step was 0.10-0.36 s faster in five A/B pairs (issue 19)."""
    if bits.device.type != "cpu" or torch.jit.is_tracing():
        return unpack_rows(bits, shape, rows)
    start, count = _elements_of_rows(shape, rows)
    chunk = bits[start // 8:packed_size(start + count)]
    index = _WS.take("index", chunk.shape, torch.int32, "cpu").copy_(chunk)
    flags = torch.index_select(_FLAGS_OF_BYTE, 0, index, out=_WS.take("flags", chunk.shape, torch.int64, "cpu"))
    return flags.view(torch.bool).narrow(0, start % 8, count).view(rows.stop - rows.start, *shape[1:])


def write_bits(bits: Tensor, start: int, keep: Tensor) -> Tensor:
    """Pack ``keep`` into elements ``[start, start + keep.numel())`` of ``bits`` (``start`` a
    multiple of 8, as a writer's slices are); return whether a bit changed (a device tensor:
    no host sync)."""
    if start % 8:
        raise ValueError(f"start: {start} is not a multiple of 8")
    new = pack_bits(keep).to(bits.device)
    dst = bits.narrow(0, start // 8, new.numel())
    changed = torch.ne(dst, new).any()
    dst.copy_(new)
    return changed
