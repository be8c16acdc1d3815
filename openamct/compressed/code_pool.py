"""int8 buffers that hold a compressed Linear's effective weight as grid values from a training
forward to its backward, reused from step to step (issue 19). Where the weight's gradient buffer
is free, the grid values go there instead (``grad_pool.GradPool.codes_for``); these buffers are
for the rest: a frozen weight, a ``.grad`` kept across forwards (accumulation), a second call
before the backward.

Why reuse: a fresh buffer per forward is a quarter of the weights' bytes allocated every step;
glibc gives large blocks back to the kernel when they are freed, so each step page-faults them
in again (this VM writes fresh pages at 0.2-0.5 s/GB): at 250M parameters that cost more than
the codes saved.

Why not one buffer per layer: a layer called twice before one backward (shared layers, two
forwards, then one backward) needs two. So a buffer is lent to one autograd context and is free
again once that context is gone, or once its backward has run and released what it saved (a
backward with ``retain_graph`` keeps them, and so keeps the buffer).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

__all__ = ["CodePool"]


class CodePool:
    """int8 buffers by (shape, device), each lent to one autograd context at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple, list[list]] = {}  # key -> [[buffer, weakref to its context], ...]

    def lend(self, shape: torch.Size, device: torch.device, ctx) -> Tensor:
        """A buffer for ``ctx``, which must set ``ctx.codes_read = True`` in its backward."""
        key = (tuple(shape), torch.device(device))
        with self._lock:
            entries = self._held.setdefault(key, [])
            for entry in entries:
                if _released(entry[1]):
                    entry[1] = weakref.ref(ctx)
                    return entry[0]
            buf = torch.empty(shape, dtype=torch.int8, device=device)
            entries.append([buf, weakref.ref(ctx)])
            return buf

    def release(self) -> None:
        """Forget every buffer (contexts still alive keep theirs)."""
        with self._lock:
            self._held.clear()

    def __len__(self) -> int:
        return sum(len(v) for v in self._held.values())


def _released(ref: weakref.ref) -> bool:
    ctx = ref()
    if ctx is None:
        return True
    if not getattr(ctx, "codes_read", False):
        return False
    try:  # after a backward without retain_graph autograd has freed the saved tensors
        _ = ctx.saved_tensors
    except RuntimeError:
        return True
    return False
