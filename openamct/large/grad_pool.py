"""Weight-gradient buffers that a compressed Linear's backward reuses from step to step.

Why: with ``optimizer.zero_grad(set_to_none=True)`` (PyTorch's default) every step frees its
weight gradients, as many bytes as the weights, and glibc gives such blocks back to the kernel.
The next backward faults them in again. On a virtual machine with free page
reporting (freed pages go back to the host: a Firecracker guest) that cost 0.2-1.7 s/GB, up to half of a 250M
model's step. The gradient a backward returns here is written into the buffer the last step's
``.grad`` used, once nothing but this pool still holds that buffer.

When a buffer is lent, so that no one's tensor is ever overwritten and no memory is held that
a plain step would not hold:
- only when the weight has no ``.grad``: autograd then adopts the returned tensor as ``.grad``
  without a copy. With a ``.grad`` (gradient accumulation, ``set_to_none=False``, DDP's bucket
  views) the gradient is only a temporary that autograd adds in; it is allocated as before, and
  a pooled buffer that is not that ``.grad`` is dropped;
- only when the buffer's storage has no other user (``.grad``, a view, a copy the caller kept,
  an optimizer's or hook's reference): counted by torch on the storage itself. Where torch
  does not expose that count nothing is pooled;
- never under ``create_graph`` (autograd then copies what backward returns).

A training forward also keeps E's int8 grid values (``codes``) until its backward, a quarter of
the weight's bytes. They go into the first quarter of the same buffer (``codes_for``): the
backward reads them for the input gradient before it writes the weight gradient over them. The
first step then maps 1 W of new memory instead of 1.25 W (0.9 GB fewer page faults at 1.1B
parameters, measured), and training holds no separate 0.25 W of codes. Only under the same rules:
where the buffer is not free (a ``.grad`` kept, accumulation) the codes get a buffer of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["GradPool", "use_count_api"]


def use_count_api():
    """torch's private ``torch._C._storage_Use_Count`` (how many tensors use a storage), or None
    where this torch has no such function: the pool then lends nothing and every backward
    allocates its gradient, the plain path. ``tests/unit/test_grad_pool.py`` fails loudly if
    torch removes or changes it."""
    return getattr(torch._C, "_storage_Use_Count", None)


def _alone_count(use_count) -> int | None:
    """What ``use_count`` reports for a storage that one tensor alone uses, asked as ``_free``
    asks (the storage object made to ask may or may not count): measured, not assumed."""
    if use_count is None:
        return None
    t = torch.empty(1)
    return use_count(t.untyped_storage()._cdata)


class GradPool:
    """One gradient buffer per weight, known by weak reference to the weight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._use_count = use_count_api()
        self._alone = _alone_count(self._use_count)  # None: nothing is pooled

    def out_for(self, w: Tensor, like: Tensor, codes: Tensor | None = None,
                new: Callable[[Tensor], Tensor] | None = None) -> Tensor | None:
        """A buffer to write ``w``'s gradient into (``like``: a tensor of the gradient's dtype
        and device), or None for a fresh one. Call it inside backward, once per gradient.
        ``codes``: what ``codes_for`` gave this backward's forward, which the caller has read
        for the last time (it may be overwritten). ``new(w)``: makes a buffer when one is due
        (default: ``empty_like``)."""
        if self._alone is None or torch.is_grad_enabled() or not w.is_leaf or like.dtype != w.dtype \
                or like.device != w.device or not w.is_contiguous():
            return None
        with self._lock:
            buf = self._held.get(w)
            if w.grad is not None:  # the gradient is a temporary added into .grad
                if buf is not None and not _same_storage(buf, w.grad):
                    del self._held[w]
                return None
            spent = int(codes is not None and buf is not None and _same_storage(buf, codes))
            if not _fits(buf, w) or not self._free(buf, spent):
                buf = self._new(w, new)
            return buf

    def codes_for(self, w: Tensor) -> Tensor | None:
        """An int8 tensor of ``w``'s shape over the first bytes of its gradient buffer, for a
        training forward's grid values, or None (give them a buffer of their own). Only for a
        weight whose backward will want that buffer: a leaf that requires grad and has no
        ``.grad``, whose buffer nothing else uses."""
        if self._alone is None or not (w.is_leaf and w.requires_grad and w.is_contiguous()):
            return None
        with self._lock:
            if w.grad is not None:
                return None
            buf = self._held.get(w)
            if not _fits(buf, w):
                buf = self._new(w)
            elif not self._free(buf):
                return None
            return torch.empty(0, dtype=torch.int8, device=w.device).set_(buf.untyped_storage(), 0, w.shape)

    def _new(self, w: Tensor, new: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """A buffer for ``w``, held from now on in place of its last (call under the lock)."""
        buf = new(w) if new is not None else torch.empty_like(w, memory_format=torch.contiguous_format)
        self._held[w] = buf
        return buf

    @staticmethod
    def handed(buf: Tensor) -> Tensor:
        """What backward returns for ``buf``: a tensor of its own over the same memory, which
        autograd adopts as ``.grad`` without a copy (it copies a tensor someone else holds)."""
        return buf.detach()

    def release(self) -> None:
        """Forget every buffer (a ``.grad`` that uses one keeps it)."""
        with self._lock:
            self._held.clear()

    def __len__(self) -> int:
        return len(self._held)

    def _free(self, buf: Tensor, spent: int = 0) -> bool:
        # Any user of the storage besides ``buf`` (.grad, a view, a kept reference) adds one;
        # ``spent``: users known to be done with it (the backward's codes, read already).
        return self._use_count(buf.untyped_storage()._cdata) <= self._alone + spent


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _fits(buf: Tensor | None, w: Tensor) -> bool:
    return buf is not None and (buf.shape, buf.dtype, buf.device) == (w.shape, w.dtype, w.device)
