"""Embedding tables whose weight gradient reuses the memory of the last step's freed ``.grad``,
as a compressed Linear's does (grad_pool.py).

Why: a table's gradient is as large as the table (32000 x 512 float32, 65 MB, in a 60M Llama;
262 MB at 1.1B), and torch's embedding backward allocates and zero-fills a new one every step.
With ``zero_grad(set_to_none=True)`` glibc hands the freed block back to the kernel, so that fill
faults in new pages each time: on a Firecracker guest with free page reporting it was most of what a step of a 60M
Llama still faulted once its Linears pooled their gradients.

The values are torch's bit for bit: zeros, then each looked-up row's gradient added in the order
of the ids (``index_add_``), the order in which ``embedding_dense_backward`` adds them; the
``padding_idx`` row stays zero. Only a plain table is swapped (``type(m) is nn.Embedding``: a
subclass has a forward of its own) whose weight no other module shares (a tied head adds its
own gradient to it, which autograd then sums into a new tensor anyway), without ``max_norm``
(which renormalises the table in place), ``sparse`` or ``scale_grad_by_freq``. Those are checked
again at each call (a caller may set them later), and the path is taken only on CPU, for a float
table, while a gradient is wanted and no graph is captured; otherwise it is
``nn.Embedding.forward``.

A step looks up a few rows of a large table, so the buffer is not zeroed whole: a new one is an
anonymous mapping (zero by the kernel, and its pages are only mapped where rows are written), and
a reused one has only the rows the last backward wrote zeroed again, provided its version counter
says nothing wrote to it since (a caller's in-place change to ``.grad`` bumps it: then all of it
is zeroed). At 250M parameters the first step's zero-fill of a 131 MB table took 0.14 s on pages
the host still backed, and more on new ones; a steady step wrote 131 MB of zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function
from torch.utils.weak import WeakIdKeyDictionary

from openamct.graph.layers import module_aliases, parameter_owners
from openamct.large.memory import zero_mapped
from openamct.quant.functions import graph_mode

__all__ = ["PooledGradEmbedding", "pool_embedding_grads"]


class PooledGradEmbedding(nn.Embedding):
    """``nn.Embedding`` whose training backward writes the weight gradient into a pooled buffer.
    The state dict, the attributes and ``isinstance(m, nn.Embedding)`` are those of the table."""

    def forward(self, input: Tensor) -> Tensor:
        w = self.weight
        rt = self.__dict__.get("large")
        if (rt is not None and torch.is_grad_enabled() and w.requires_grad and w.device.type == "cpu"
                and w.is_floating_point()
                and self.max_norm is None and not self.sparse and not self.scale_grad_by_freq
                and input.dtype in (torch.int64, torch.int32) and not graph_mode()):
            return _EmbeddingGrad.apply(input, w, self.padding_idx, rt)
        return super().forward(input)

    def train(self, mode: bool = True) -> PooledGradEmbedding:
        rt = self.__dict__.get("large")
        if not mode and rt is not None:  # as a compressed layer does: eval and export hold no gradient buffers
            rt.release()
        return super().train(mode)


class _EmbeddingGrad(Function):
    @staticmethod
    def forward(ctx, ids: Tensor, w: Tensor, padding_idx: int | None, rt) -> Tensor:
        ctx.save_for_backward(ids, w)
        ctx.padding_idx, ctx.rt = padding_idx, rt
        return F.embedding(ids, w, padding_idx)

    @staticmethod
    def backward(ctx, g: Tensor):
        ids, w = ctx.saved_tensors  # (only a weight that requires grad comes this way)
        pool, written = ctx.rt.grads, ctx.rt.embedding_rows
        out = pool.out_for(w, g, new=lambda t: _zeroed_like(t, written))
        rows = ids.reshape(-1)
        if out is None:
            gw = torch.zeros_like(w)
        else:
            gw = out
            seen = written.pop(w, None)
            if seen is not None and seen[0] == (gw.data_ptr(), gw._version):
                gw.index_fill_(0, seen[1], 0)
            else:
                gw.zero_()
        gw.index_add_(0, rows, g.reshape(-1, w.shape[1]))
        if ctx.padding_idx is not None:
            gw[ctx.padding_idx].zero_()
        if out is None:
            return None, gw, None, None
        written[w] = ((gw.data_ptr(), gw._version), rows.to(torch.int64, copy=True))
        return None, pool.handed(gw), None, None


def _zeroed_like(w: Tensor, written: WeakIdKeyDictionary) -> Tensor:
    """A new pool buffer for ``w``: zero, its pages mapped only where written; recorded as all
    zero in ``written`` (weight -> ((its pooled buffer's address, the buffer's version), the rows
    written since it was last all zero): what a backward must zero again before it adds)."""
    buf = zero_mapped(w)
    written[w] = ((buf.data_ptr(), buf._version), torch.empty(0, dtype=torch.int64))
    return buf


def pool_embedding_grads(model: nn.Module, runtime) -> list[str]:
    """Make the plain, unshared embedding tables of ``model`` (a working copy) pool their weight
    gradient in ``runtime`` (a ``LargeRuntime``); returns their names."""
    owners, aliases = parameter_owners(model), module_aliases(model)
    done = []
    for name, m in model.named_modules():
        if type(m) is nn.Embedding and len(owners[id(m.weight)]) == 1 and len(aliases[id(m)]) == 1 \
                and m.max_norm is None and not m.sparse and not m.scale_grad_by_freq:
            m.__class__ = PooledGradEmbedding
            m.large = runtime
            done.append(name)
    return done
