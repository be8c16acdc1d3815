"""Give memory back to the operating system: freed heap between the phases of a save, and the
pages of a memory-mapped checkpoint once they are copied into the model.

Why: glibc serves allocations below its mmap threshold (up to 32 MB, raised as
larger blocks are freed) from the heap, and a heap with a small live block above freed ones
cannot shrink. A save's per-layer temporaries left 0.1-0.9 W of freed memory counted in the
process's RSS at 250M parameters (measured with RSS sampling; ``malloc_trim`` returned it all),
and the next phase's peak sat on top of it. ``malloc_trim(0)`` releases free pages anywhere in
the heap; it changes no allocation. Other C libraries: nothing to do, nothing done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

__all__ = ["return_free_memory", "drop_file_pages", "drop_file_range", "zero_mapped"]


def _libc_function(name: str, argtypes: list, restype):
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_TRIM = _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
_MADVISE = _libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # Linux, macOS


def return_free_memory() -> None:
    if _TRIM is not None:
        _TRIM(0)


def drop_file_pages(tensors: Iterable[torch.Tensor]) -> None:
    """Drop the resident pages of tensors that ``torch.load(mmap=True)`` mapped from a file and
    that will not be written: read again, they come back from the file. A restore copies a
    checkpoint into the model a part at a time and drops each part's pages, so it holds the
    working copy plus one part instead of plus the whole file (+2.2x the weights at
    1.1B parameters). Only for file mappings: on anonymous memory the same call would zero the
    pages, so callers pass nothing else. Where madvise is missing, nothing is done (the kernel
    still reclaims clean file pages under pressure)."""
    for t in tensors:
        storage = t.untyped_storage()
        _drop(storage.data_ptr(), storage.nbytes())


def drop_file_range(t: torch.Tensor) -> None:
    """``drop_file_pages`` for the whole pages under one contiguous tensor, not its storage: a
    slice of a mapped tensor once copied (a tensor larger than a restore's load part)."""
    _drop(t.data_ptr(), t.numel() * t.element_size())


def _drop(start: int, nbytes: int) -> None:
    if _MADVISE is None or _DONTNEED is None:
        return
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + nbytes) // page * page
    if hi > lo:  # whole pages inside the range; an edge page shared with a neighbour stays
        _MADVISE(lo, hi - lo, _DONTNEED)


def zero_mapped(like: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of ``like``'s shape and dtype over a private anonymous mapping:
    zero without being written (the kernel's zero pages), and only the pages written get memory.
    A tensor of its own over the mapping's storage, not a view (a view's base counts as one more
    user of the storage, which the gradient pool reads)."""
    if like.numel() == 0:
        return torch.zeros(like.shape, dtype=like.dtype)
    area = mmap.mmap(-1, like.numel() * like.element_size(), flags=mmap.MAP_PRIVATE)
    mapped = torch.frombuffer(area, dtype=like.dtype)  # keeps ``area`` alive
    return torch.empty(0, dtype=like.dtype).set_(mapped.untyped_storage(), 0, like.shape)
