"""Bit-packing of 0/1 sparsity masks into signed int64 words for the prune record.

Layout (upstream's ``selective_prune`` ``selective_mask``, docs/dev/reference.md, Record): flatten the mask in C
order; pack 8 elements per byte with the FIRST element in the byte's most significant bit
(``numpy.packbits``' default), zero-pad to whole 8-byte words and read each 8 bytes as a
little-endian int64. That is upstream AMCT's layout, so records stay readable both ways. The last
word's unused bits are zero. Words are Python ints in the int64 range (two's complement), as ONNX-style
``ints`` attributes store them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["pack_mask", "words_of_bits", "bits_of_words", "unpack_mask", "num_words", "packed_size", "pack_bits",
           "unpack_bits", "unpack_rows", "write_bits"]

_BITS = 64
_INT64_MIN = -(1 << 63)
_INT64_END = 1 << 63


def num_words(numel: int) -> int:
    """How many int64 words a mask of ``numel`` elements packs into."""
    return -(-numel // _BITS)


def pack_mask(mask: Tensor | np.ndarray) -> tuple[list[int], list[int]]:
    """Pack a 0/1 mask; returns ``(shape, words)``. ``ValueError`` for any other value."""
    if isinstance(mask, Tensor):
        array = mask.detach().cpu().numpy() if mask.dtype != torch.bfloat16 else (
            mask.detach().cpu().float().numpy())
    elif isinstance(mask, np.ndarray):
        array = mask
    else:
        raise TypeError(f"mask: expected a torch.Tensor or numpy array, got {type(mask).__name__}")
    shape = [int(d) for d in array.shape]
    flat = array.reshape(-1)
    if flat.dtype == np.bool_:
        bits = flat
    else:
        if not np.all((flat == 0) | (flat == 1)):
            raise ValueError("mask: values must be 0 or 1")
        bits = flat != 0
    padded = np.zeros(num_words(bits.size) * _BITS, dtype=np.bool_)
    padded[: bits.size] = bits
    # packbits puts element 8j+i at bit (7 - i) of byte j; the 8-byte little-endian view makes
    # byte j of a word its bits 8j..8j+7 (upstream's order).
    words = np.packbits(padded, bitorder="big").view("<i8")
    return shape, words.tolist()


def words_of_bits(bits: Tensor) -> bytes | memoryview:
    """The words of a packed mask (``mask_bits.pack_bits``' layout: the same bit order) as
    little-endian bytes: its bytes, zero-padded to whole words. Nothing is unpacked; without
    padding to add, a view of the tensor's memory (no copy: read it before the mask changes)."""
    raw = bits.detach().cpu().numpy()
    pad = (-raw.size) % 8
    return raw.tobytes() + bytes(pad) if pad else memoryview(raw).cast("B")


def bits_of_words(shape: Sequence[int], words: Sequence[int] | np.ndarray) -> Tensor:
    """A record's words as a packed mask (``mask_bits.pack_bits``' layout: their bytes, the
    word padding dropped), checked as :func:`unpack_mask` checks them; nothing is unpacked."""
    dims, numel, packed = _checked_words(shape, words)
    raw = packed.astype("<i8", copy=False).view(np.uint8)
    nbytes = -(-numel // 8)
    tail = raw[nbytes:]
    spare = numel % 8 and int(raw[nbytes - 1]) & ((1 << (8 - numel % 8)) - 1)
    if tail.any() or spare:
        raise ValueError(f"words: bits set past element {numel} of mask shape {dims}: "
                         "the words do not belong to this shape")
    return torch.from_numpy(raw[:nbytes].copy())


def unpack_mask(
    shape: Sequence[int], words: Sequence[int] | np.ndarray, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`pack_mask`: a 0/1 tensor of ``shape`` and ``dtype``.

    ``ValueError`` when the word count does not fit the shape, a word is outside the int64
    range, or a padding bit past the last element is set (the words belong to another shape).
    """
    bits = np.unpackbits(bits_of_words(shape, words).numpy(), bitorder="big")
    numel = math.prod(int(d) for d in shape)
    return torch.from_numpy(bits[:numel].reshape([int(d) for d in shape])).to(dtype)


def _checked_words(shape: Sequence[int], words: Sequence[int] | np.ndarray) -> tuple[list[int], int, np.ndarray]:
    """(dims, element count, words as int64) after the checks both readers share."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, torch.Size)):
        raise TypeError(f"shape: expected a sequence of ints, got {type(shape).__name__}")
    dims = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"shape: expected ints, got {type(d).__name__} in {list(shape)}")
        if d < 0:
            raise ValueError(f"shape: dimensions must be >= 0, got {list(shape)}")
        dims.append(int(d))
    numel = int(np.prod(dims, dtype=np.int64)) if dims else 1
    expected = num_words(numel)
    if len(words) != expected:
        raise ValueError(
            f"words: {len(words)} int64 words do not fit mask shape {dims} "
            f"({numel} elements need {expected})"
        )
    if isinstance(words, np.ndarray):
        if words.dtype.kind not in "iu" or words.dtype.itemsize != 8:
            raise TypeError(f"words: expected 64-bit integers, got {words.dtype}")
        packed = np.ascontiguousarray(words).view("<i8")
    else:
        try:
            packed = np.asarray(words, dtype=np.int64)
        except OverflowError:
            bad = next(w for w in words if not _INT64_MIN <= w < _INT64_END)
            raise ValueError(f"words: {bad} is outside the int64 range") from None
        except (TypeError, ValueError) as exc:
            raise TypeError(f"words: expected ints ({exc})") from None
    return dims, numel, packed


# -- the sparsifier's packed mask (NMSparsifier.mask_bits) ----------------------------------------
# One bit per weight in the record's bit order: the weight flattened in C order, element ``i`` at
# bit ``7 - i % 8`` of byte ``i // 8``, unused bits of the last byte zero. The record's words are
# these bytes zero-padded to whole 8-byte words.

def _shifts(device: torch.device, dtype: torch.dtype = torch.uint8) -> Tensor:
    """The bit of each of a byte's 8 elements, made on ``device`` (no copy from the host)."""
    return torch.arange(7, -1, -1, dtype=dtype, device=device)


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
    weights = (1 << _shifts(flat.device, torch.int32)).to(torch.uint8)
    return (flat.view(-1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(bits: Tensor, start: int, count: int) -> Tensor:
    """Elements ``[start, start + count)`` of a packed mask, as a flat bool tensor."""
    b0, b1 = start // 8, packed_size(start + count)
    chunk = bits[b0:b1]
    if chunk.device.type == "cpu" and not torch.compiler.is_compiling():
        flags = torch.from_numpy(np.unpackbits(chunk.numpy()))
    else:
        flags = (chunk.unsqueeze(-1) >> _shifts(chunk.device)).bitwise_and_(1).reshape(-1)
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
