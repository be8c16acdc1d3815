"""``LargeRuntime``: the buffers the CPU large-model paths reuse from call to call, owned by one
compressed model (its record keeper holds it; each compressed Linear and pooled embedding table
of that model points at it), never by a module.

- ``scratch``: the fused Linear's effective-weight and slice buffers (``fused_linear``);
- ``grads``: weight-gradient buffers reused from step to step (``grad_pool``).

A deep copy or a pickle of the model gets a fresh, empty runtime (buffers are never copied).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from openamct.large.fused_linear import large_forward, takes_large_path
from openamct.large.grad_pool import GradPool
from openamct.large.workspace import Workspace

__all__ = ["LargeRuntime", "attach_runtime", "large_path_wanted"]


class LargeRuntime:
    """The reusable buffers of one compressed model's CPU large-model paths."""

    def __init__(self) -> None:
        self.scratch = Workspace()
        self.grads = GradPool()
        self.embedding_rows = WeakIdKeyDictionary()  # embedding_grad.py: rows to zero again per table

    def takes(self, layer, x: Tensor) -> bool:
        """Whether ``layer`` (a CompressedLayer holding this runtime) computes ``x`` by the fused
        Linear (``fused_linear.takes_large_path``: CPU tensors, a Linear whose weight path is
        only a 2:4 mask and/or ARQ, an eager float forward)."""
        # A compiled forward takes the plain path: the fused Linear's pools and locks are eager
        # CPU machinery that a compiler cannot capture.
        return not torch.compiler.is_compiling() and takes_large_path(layer, x)

    def forward(self, layer, x: Tensor) -> Tensor:
        """``layer``'s output for ``x`` where ``takes`` said so (``fused_linear.large_forward``)."""
        return large_forward(layer, x)

    def release(self) -> None:
        """Give every buffer back (eval and save call it; the next training step maps them again)."""
        self.scratch.release()
        self.grads.release()
        self.embedding_rows.clear()

    def __reduce__(self):  # deepcopy and pickle: a fresh runtime, no buffers
        return (LargeRuntime, ())


def large_path_wanted(model: nn.Module) -> bool:
    """Build's branch condition: every parameter and buffer of ``model`` on the CPU (the
    large-model paths are CPU-only; a model on CUDA or meta keeps the plain PyTorch path)."""
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def attach_runtime(model: nn.Module, layers) -> LargeRuntime:
    """Give ``model``'s compressed ``layers`` (name -> CompressedLayer) one runtime and let its
    plain embedding tables reuse their gradient buffers there; the runtime, for its owner."""
    from openamct.large.embedding_grad import pool_embedding_grads

    runtime = LargeRuntime()
    for layer in layers.values():
        layer.large = runtime
    pool_embedding_grads(model, runtime)
    return runtime
