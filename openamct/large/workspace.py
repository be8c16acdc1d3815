"""Buffers that a hot loop reuses from call to call instead of allocating.

Why: glibc serves a block above its mmap threshold (128 KB, raised up to 32 MB as such blocks
are freed) with a fresh mapping, and trims a heap whose free top outgrows twice the threshold.
A loop that allocates a few MB per slice (a 2:4 mask recompute, an activation clip search) can
so page-fault its temporaries again on every slice: at 1.1B parameters the first training step
spent 1.1 s in ``abs`` of 4 MB slices whose arithmetic takes 0.1 s (a 2-core EPYC faults fresh
pages at 0.25-1.3 s/GB). A buffer kept here is mapped once and stays in the cache.

One ``Workspace`` per module that needs one; each is thread-local (a DDP job or a data loader
thread must not share a buffer mid-use). What ``take`` returns is valid until the next ``take``
of the same name on that thread: callers consume it before they ask again.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Workspace"]


class Workspace(threading.local):
    """Flat buffers per (name, dtype, device), grown to the largest request seen."""

    def __init__(self) -> None:
        self.tensors: dict[tuple, Tensor] = {}

    def take(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> Tensor:
        numel = math.prod(shape)
        key = (name, dtype, torch.device(device))
        flat = self.tensors.get(key)
        if flat is None or flat.numel() < numel:
            self.tensors.pop(key, None)  # free the smaller one before mapping the larger
            flat = self.tensors[key] = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel].view(tuple(shape))

    def take_like(self, name: str, like: Tensor) -> Tensor:
        return self.take(name, like.shape, like.dtype, like.device)

    def release(self) -> None:
        self.tensors.clear()
