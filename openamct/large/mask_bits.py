"""CPU fast paths for packed 2:4 masks whose temporaries live in a ``Workspace``.

Why: ``np.unpackbits`` and the 2:4 comparisons return new tensors per call, a few MB per slice
of rows; above glibc's mmap threshold each is a fresh mapping that page-faults again on every
slice. The packed layout and the plain (allocating) functions are ``record/mask_codec.py``'s and
``sparsity/nm_keep.py``'s; these give the same bits from buffers the caller owns (a
``LargeRuntime``'s, or one made for a single mask recompute).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from openamct.large.workspace import Workspace
from openamct.record.mask_codec import _elements_of_rows, packed_size, unpack_rows
from openamct.sparsity.nm_keep import _vote24

__all__ = ["unpack_rows_reused", "keep24_into"]

# Byte value -> its 8 flags as one int64 (their bytes in element order): unpacking is then one
# gather into a kept buffer (``unpack_rows_reused``). A constant, never written.
_FLAGS_OF_BYTE = torch.from_numpy(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).copy()).view(torch.int64).reshape(256)


def unpack_rows_reused(bits: Tensor, shape: tuple[int, ...] | torch.Size, rows: slice, ws: Workspace) -> Tensor:
    """``unpack_rows`` into ``ws``'s buffers: valid until the next call with that workspace.

    Why: ``np.unpackbits`` returns a new array per call. In a 250M-parameter model's first
    training step its 240 unpacks of ~1 MB took 0.32 s (0.015 s in later steps), fresh memory
    each time; from this buffer the first step is 0.10-0.36 s faster."""
    if bits.device.type != "cpu" or torch.jit.is_tracing():
        return unpack_rows(bits, shape, rows)
    start, count = _elements_of_rows(shape, rows)
    chunk = bits[start // 8:packed_size(start + count)]
    index = ws.take("index", chunk.shape, torch.int32, "cpu").copy_(chunk)
    flags = torch.index_select(_FLAGS_OF_BYTE, 0, index, out=ws.take("flags", chunk.shape, torch.int64, "cpu"))
    return flags.view(torch.bool).narrow(0, start % 8, count).view(rows.stop - rows.start, *shape[1:])


def keep24_into(x: Tensor, axis: int, ws: Workspace) -> Tensor:
    """:func:`nm_keep_flags` for 2:4 when ``x.shape[axis]`` is a multiple of 4 (no padding), with
    every temporary in ``ws``: the result is a view of a workspace buffer, valid until the
    next call. The same majority votes as ``_keep_flags`` (``_vote24``), written straight into
    the result's four positions, so a mask recompute allocates nothing per slice (at 1.1B
    parameters the fresh |w| and bool planes of each 4 MB slice took 1.4 of the 2.4 s the first
    step spent on masks)."""
    shape, dev = x.shape, x.device
    mag = torch.abs(x, out=ws.take("mag", shape, x.dtype, dev)).nan_to_num_(nan=float("inf"))
    groups = mag.unflatten(axis, (shape[axis] // 4, 4))
    pos = groups.unbind(axis + 1)
    keep = ws.take("keep", groups.shape, torch.bool, dev)
    _vote24(pos, keep.unbind(axis + 1), lambda name: ws.take(name, pos[0].shape, torch.bool, dev))
    return keep.flatten(axis, axis + 1)


def keep24_in_workspace(axis: int):
    """``NMSparsifier.keep24`` on CPU models: the keep-flags function of one mask recompute
    along ``axis``, every slice's temporaries in one ``Workspace`` made here for it."""
    ws = Workspace()
    return lambda x: keep24_into(x, axis, ws)
