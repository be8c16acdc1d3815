"""``nn.MultiheadAttention`` in the compressed working copy: the same function with its
projections as ``nn.Linear`` children and its attention products as explicit matmuls.

Why: torch's ``nn.MultiheadAttention`` keeps its packed Q/K/V projection as a bare Parameter
(``in_proj_weight``) and reads ``out_proj`` with ``F.linear`` inside
``F.multi_head_attention_forward``; in eval under no_grad it takes a fused kernel
(``aten::_native_multi_head_attention``) that calls neither, and with ``need_weights=False`` its
unfused path runs ``scaled_dot_product_attention``. So neither projection is a layer a
technique can compress (about a third of a ViT's MACs stay float) and Q·Kᵀ / softmax·V are no
MatMul the activation MatMul quantizers can reach.

What: ``substitute_attention`` replaces each plain ``nn.MultiheadAttention`` of the working copy
(never the caller's model) by ``UnfusedMultiheadAttention`` before graph capture, so create and
restore capture, plan and record the same tree (``<mha>.in_proj``, ``<mha>.out_proj``). Its
Parameters are the original's (``in_proj.weight`` is ``in_proj_weight``), its forward computes
what the unfused ``F.multi_head_attention_forward`` does for the arguments below, with no fast
path, so training, eval and export run the same code:

- self-attention (``query is key is value``): one call of ``in_proj`` (a Linear E -> 3E), so the
  in-projection is one ordinary layer. Cross-attention (shared embedding size): which one a
  module computes shows only when it runs, so the first capture finds each module whose packed
  ``in_proj`` was not called (its forward computed the projections with ``F.linear`` on slices
  of the weight), ``split_cross_attention`` gives it ``q_proj`` / ``k_proj`` / ``v_proj`` (copies
  of the thirds) and the pipeline captures again: each is then a layer of its own;
- ``batch_first`` either way, unbatched inputs, ``attn_mask`` (2-D or 3-D, bool or float),
  ``key_padding_mask``, ``need_weights`` / ``average_attn_weights``, ``is_causal`` (a hint that
  ``attn_mask`` is causal: the mask is applied as given), dropout on the attention weights;
- ``q @ k^T`` and ``softmax @ v`` are ``torch.matmul`` calls of this module's forward, the sites
  ``techniques/matmul_quant.py`` finds under ``quantize_activation_matmul``.

Left as they are (float), one WARNING per reason: ``add_bias_kv``, ``add_zero_attn``,
``kdim``/``vdim`` other than ``embed_dim``, a subclass (its own forward), one with forward hooks,
the model itself.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from openamct.graph.graph import Graph
from openamct.log_summary import warn_grouped

__all__ = ["UnfusedMultiheadAttention", "split_cross_attention", "substitute_attention"]

logger = logging.getLogger(__name__)

SPLIT = ("q_proj", "k_proj", "v_proj")  # the children of the cross-attention layout


def _float_mask(mask: Tensor | None, name: str, dtype: torch.dtype) -> Tensor | None:
    """A bool mask as 0 / -inf (True: not attended), a float mask as it is (added to the scores)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"{name}: only bool and floating-point masks are supported, got {mask.dtype}")
    return mask


class UnfusedMultiheadAttention(nn.Module):
    """The function of ``nn.MultiheadAttention`` (module docstring) with ``in_proj`` (or, after
    ``split_in_proj``, ``q_proj`` / ``k_proj`` / ``v_proj``) and ``out_proj`` Linear children. Built by ``from_torch``; the attributes torch's Transformer
    layers read (``batch_first``, ``num_heads``, ``in_proj_weight``, ``in_proj_bias``) are kept,
    and ``_qkv_same_embed_dim`` is False so those layers never take their fused kernels, which
    would read the float weights past the compressed layers."""

    _qkv_same_embed_dim = False  # read by nn.TransformerEncoder(Layer)'s fast-path checks

    def __init__(self, embed_dim: int, num_heads: int, dropout: float, batch_first: bool,
                 in_proj: nn.Linear, out_proj: nn.Linear) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.head_dim = embed_dim // num_heads
        self.in_proj, self.out_proj = in_proj, out_proj

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> UnfusedMultiheadAttention:
        """Share ``mha``'s Parameters (no copy: the working copy's own tensors)."""
        e = mha.embed_dim
        in_proj = nn.Linear(e, 3 * e, bias=mha.in_proj_bias is not None, device="meta")
        in_proj.weight = mha.in_proj_weight
        if mha.in_proj_bias is not None:
            in_proj.bias = mha.in_proj_bias
        out_proj = nn.Linear(e, e, bias=mha.out_proj.bias is not None, device="meta")
        out_proj.weight = mha.out_proj.weight
        if mha.out_proj.bias is not None:
            out_proj.bias = mha.out_proj.bias
        new = cls(e, mha.num_heads, float(mha.dropout), bool(mha.batch_first), in_proj, out_proj)
        new.train(mha.training)
        return new

    @torch.no_grad()
    def split_in_proj(self) -> None:
        """Replace the packed ``in_proj`` by ``q_proj``, ``k_proj``, ``v_proj`` (Linears E -> E
        holding copies of its thirds, requires_grad kept): the layout for cross-attention, where
        each projection reads another input and so is its own layer call."""
        w, b = self.in_proj.weight, self.in_proj.bias
        for i, name in enumerate(SPLIT):
            lin = nn.Linear(self.embed_dim, self.embed_dim, bias=b is not None, device="meta")
            lin.weight = nn.Parameter(w[i * self.embed_dim:(i + 1) * self.embed_dim].clone(), w.requires_grad)
            if b is not None:
                lin.bias = nn.Parameter(b[i * self.embed_dim:(i + 1) * self.embed_dim].clone(), b.requires_grad)
            setattr(self, name, lin)
        del self.in_proj

    @property
    def split(self) -> bool:
        return "in_proj" not in self._modules

    @property
    def in_proj_weight(self) -> Tensor:
        return torch.cat([getattr(self, n).weight for n in SPLIT]) if self.split else self.in_proj.weight

    @property
    def in_proj_bias(self) -> Tensor | None:
        if not self.split:
            return self.in_proj.bias
        return None if self.q_proj.bias is None else torch.cat([getattr(self, n).bias for n in SPLIT])

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(N, L, E) inputs -> q, k, v as (N, H, L, head_dim). The heads are split by ``unflatten``
        with the head count written out, which filter pruning's head analysis refuses
        (``sparsity/heads.py``): ``embed_dim`` and ``num_heads`` here would not follow pruned heads."""
        h, d = self.num_heads, self.head_dim
        if self.split:
            return tuple(getattr(self, n)(x).unflatten(-1, (h, d)).transpose(1, 2)
                         for n, x in zip(SPLIT, (query, key, value)))
        if query is key and key is value:
            qkv = self.in_proj(query).unflatten(-1, (3, h, d)).permute(2, 0, 3, 1, 4)
            return qkv[0], qkv[1], qkv[2]
        if not isinstance(self.in_proj, nn.Linear):
            raise RuntimeError("UnfusedMultiheadAttention: called with distinct query/key/value, but its in_proj "
                               "was compressed from a self-attention capture (query is key is value); a cross-"
                               "attention call would read the float weight past it")
        w, b = self.in_proj.weight.chunk(3), (self.in_proj.bias.chunk(3) if self.in_proj.bias is not None
                                              else (None,) * 3)
        return tuple(F.linear(x, w[i], b[i]).unflatten(-1, (h, d)).transpose(1, 2)
                     for i, x in enumerate((query, key, value)))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
        batched = query.dim() == 3
        same_qk, same_kv = query is key, key is value
        if not batched:  # (L, E): one batch element
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        if same_kv:  # keep the identities the in-projection's choice depends on
            value = key
            if same_qk:
                query = key
        n, tgt, src = query.shape[0], query.shape[1], key.shape[1]
        q, k, v = self._project(query, key, value)

        mask = _float_mask(attn_mask, "attn_mask", q.dtype)
        if mask is not None and mask.dim() == 3:  # (N * H, L, S), batch-major as torch lays it out
            mask = mask.view(n, self.num_heads, tgt, src)
        pad = _float_mask(key_padding_mask, "key_padding_mask", q.dtype)
        if pad is not None:
            pad = pad.view(n, 1, 1, src)
            mask = pad if mask is None else mask + pad

        scores = torch.matmul(q * math.sqrt(1.0 / self.head_dim), k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        weights = F.softmax(scores, dim=-1)
        if self.dropout > 0.0:
            weights = F.dropout(weights, p=self.dropout, training=self.training)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(n, tgt, self.embed_dim)
        out = self.out_proj(out)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return out, (weights.squeeze(0) if not batched else weights)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
                f"batch_first={self.batch_first}")


def _unsupported(mha: nn.MultiheadAttention) -> str:
    if type(mha) is not nn.MultiheadAttention:
        return f"a subclass of nn.MultiheadAttention ({type(mha).__name__}: its own forward)"
    if mha.bias_k is not None or mha.bias_v is not None:
        return "add_bias_kv=True"
    if mha.add_zero_attn:
        return "add_zero_attn=True"
    if not mha._qkv_same_embed_dim:
        return "kdim/vdim other than embed_dim (separate q/k/v projection weights)"
    if mha._forward_hooks or mha._forward_pre_hooks:
        return "it has forward hooks, which would not follow a replacement"
    return ""


def substitute_attention(model: nn.Module) -> list[str]:
    """Replace, in place, each supported ``nn.MultiheadAttention`` below ``model`` by an
    ``UnfusedMultiheadAttention`` sharing its Parameters (``model`` must be the working copy).
    A module registered under several names is replaced by one new module under all of them.
    Returns the paths replaced; the others are logged, one WARNING per reason."""
    done: dict[int, nn.Module] = {}
    left: list[tuple[str, str]] = []
    if isinstance(model, nn.MultiheadAttention):
        left.append(("(the model itself)", "the model is an nn.MultiheadAttention: wrap it in a module"))
    replaced = []
    for name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):
            if not isinstance(child, nn.MultiheadAttention):
                continue
            path = f"{name}.{child_name}" if name else child_name
            if id(child) not in done:
                why = _unsupported(child)
                if why:
                    left.append((path, why))
                    done[id(child)] = child
                    continue
                done[id(child)] = UnfusedMultiheadAttention.from_torch(child)
            if done[id(child)] is not child:
                setattr(parent, child_name, done[id(child)])
                replaced.append(path)
    for m in model.modules():
        # the encoder's eval fast path would hand the layers nested tensors (padding dropped,
        # padded outputs zero): with it off, eval computes what training and export do
        if isinstance(m, nn.TransformerEncoder) and isinstance(m.layers[0].self_attn, UnfusedMultiheadAttention):
            m.use_nested_tensor = False
    warn_grouped(logger, "nn.MultiheadAttention left as it is (float projections)", left)
    return replaced


def split_cross_attention(model: nn.Module, graph: Graph) -> list[str]:
    """After a capture: give each packed ``UnfusedMultiheadAttention`` that the capture saw
    computing cross-attention (its ``in_proj`` never called, its weight read in its own code)
    the ``q_proj`` / ``k_proj`` / ``v_proj`` layout; the paths changed (capture again if any)."""
    done = []
    for name, m in list(model.named_modules()):
        if (isinstance(m, UnfusedMultiheadAttention) and not m.split
                and not graph.module_calls.get(f"{name}.in_proj")
                and any(n.scope == name and n.kind == "function" for n in graph.nodes)):
            m.split_in_proj()
            done.append(name)
    return done
