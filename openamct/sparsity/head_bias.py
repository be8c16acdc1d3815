"""A per-head bias added to the attention scores (T5's relative position bias): an Embedding
with one column per head (``relative_attention_bias``, ``Embedding(buckets, n_heads)``) whose
output, permuted to ``[1, heads, q, k]``, is added to Q·Kᵀ.

Why it follows rather than blocks: its columns are the heads, so a pruned head's column goes
with it and the kept heads get exactly the bias they had. Its output is tracked like a layer's
output, but as a follower (no channels of its own to decide): it joins the head group it is
added to, and since T5 computes the bias once and adds it in every layer, every layer's heads
are coupled through it and lose the same heads, which is what one shared bias table demands.
A per-head bias from anything else (a constant, a buffer, ``torch.zeros((1, self.n_heads, ...))``)
keeps blocking, at the add, naming what produced it.
"""

from __future__ import annotations

import torch
from torch import nn

from openamct.graph.node import Node
from openamct.sparsity.heads import HEAD_ATTRS

EMBEDDING = "Gather"  # record type (the ONNX op an Embedding exports to)


def head_embedding(node: Node, modules: dict[str, nn.Module], calls: int) -> int | None:
    """The head count of an Embedding whose columns are its owner module's heads (the owner has
    ``n_heads``-like = embedding_dim), called once; None for any other module (token embeddings)."""
    m, owner = modules.get(node.name), modules.get(node.name.rpartition(".")[0])
    if not isinstance(m, nn.Embedding) or calls != 1 or len(node.outputs) != 1:
        return None
    heads = m.embedding_dim
    return heads if any(type(getattr(owner, a, None)) is int and getattr(owner, a) == heads
                        for a in HEAD_ATTRS) else None


def embedding_columns(m: nn.Embedding, keep: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """New weight and size of a per-head Embedding that keeps heads ``keep``."""
    index = torch.tensor(keep, dtype=torch.long, device=m.weight.device)  # on the table's device
    return {"weight": m.weight.data.index_select(1, index)}, {"embedding_dim": len(keep)}
