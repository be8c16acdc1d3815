"""Folded weights that are computed when they are written, not held.

Holding every layer's folded weight at once costs a second copy of the model while a save
runs (the fake-quant model's float weights: 1 W; the deploy model's int8: 0.25 W, plus the
exporter's proto of them and its serialised copy). So a folded layer keeps a
``DeferredWeight`` instead: it knows how to compute the weight from the compressed layer, and
only shape and dtype otherwise.

- The layer's forward reads ``placeholder``: a tensor of the right shape that exports as a node
  ``openamct::Weight(key=<name>)``. The exporter never sees the values, so it neither copies
  nor serialises them. Eager calls (``export_signature``'s probe) compute with it too: only the
  output's structure matters there. So a folded model with deferred weights is for export
  only. A placeholder is contiguous zeros over a mapping no page backs (``ZeroPages``): a
  zero-stride one would make each matmul copy it out whole first, the weight's size in new pages
  per layer and per forward, four forwards per save (at 1.1B parameters a save faulted 9.08 GB
  that way, 2.23 GB with zero pages). Reading ``layer.weight`` computes the real one,
  except while a trace runs (model code reads its dtype there: HF ViT, T5), where it is a
  zero-stride tensor of the right shape.
- ``bind_placeholders`` renames each such node's output to the initializer name the file has
  always used (``<layer>.weight``, ``.weight_t``, ``.weight_int8``): the deploy post-pass keys
  its observers by it.
- The staging writer (``staging.stage_streamed``) computes and writes one weight at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import onnx
import torch
from torch import Tensor, nn
from torch.autograd import Function
from torch.nn import functional as F
from torch.utils.weak import WeakIdKeyDictionary

from openamct.compressed.ops import as_layer_class, public_attrs
from openamct.export.export_layer import ExportLayer
from openamct.formats import INT8_WEIGHT
from openamct.large.embedding_grad import PooledGradEmbedding
from openamct.large.memory import zero_mapped
from openamct.module_tree import set_module

__all__ = ["DeferredWeight", "DeferredTable", "WriteScratch", "ZeroPages", "placeholder_value",
           "bind_placeholders", "strip_placeholders", "PLACEHOLDER_DOMAIN", "ExportEmbedding",
           "defer_tables", "deferred_weights"]

PLACEHOLDER_DOMAIN = "openamct"
_PLACEHOLDER_OP = "Weight"


@dataclass(eq=False)
class DeferredWeight:
    """One layer's stored export weight: ``layer``'s eval-mode effective weight, transposed
    to [out, in] for a Conv1D layout, then int8 through ``quantize`` (a ``WeightDQ``) or, for
    a float weight the exporter would transpose, stored as W^T (``transposed``)."""

    layer: torch.nn.Module  # the working copy's CompressedLayer (no longer in the module tree)
    shape: tuple[int, ...]  # of the weight before ``transposed``
    quantize: torch.nn.Module | None = None
    transposed: bool = False
    _placeholder: tuple | None = field(default=None, repr=False)
    zeros: ZeroPages | None = field(default=None, repr=False)  # the save's (streamed_save.py)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.quantize is None else torch.int8

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transposed else self.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.stored_shape) * (1 if self.dtype == torch.int8 else 4)

    @torch.no_grad()
    def compute(self, scratch: WriteScratch | None = None) -> Tensor:
        """The stored tensor, contiguous: what the file holds under this layer's weight name.
        With ``scratch``, a Linear's is built in its buffers (valid until the next call)."""
        w = self._effective(scratch)
        if self.layer.kind == "linear_t":
            w = w.t()
        w = w.detach().float()
        out = None if scratch is None else scratch.take(1, self.stored_shape, self.dtype)
        if self.quantize is not None:
            return self.quantize.quantize(w, out)
        if self.transposed:
            w = w.t()
        if out is None:
            return w.contiguous()
        return w if w.is_contiguous() else out.copy_(w)

    def _effective(self, scratch: WriteScratch | None) -> Tensor:
        """The eval-mode effective weight (layout as stored by the layer). A Linear whose weight
        path is a 2:4 mask and/or ARQ goes through the training step's ``_effective`` into the
        scratch (the same values bit for bit: tests) instead of two new weight-sized tensors."""
        from openamct.large.fused_linear import _effective

        layer = self.layer
        if scratch is None or not layer.plain_weight_path():
            return layer.effective_weight_bias()[0]
        sp, q = layer.sparsity, layer.wts_quant
        w = layer.weight.detach()
        mask = None if sp is None else sp.mask_bits
        out = scratch.take(0, tuple(w.shape), w.dtype)
        _effective(w, mask, None if q is None else q.channel_wise, int(layer.kind == "linear_t"), out,
                   qmax=INT8_WEIGHT.qmax if q is None else q.format.qmax)
        return out

    def placeholder_value(self, key: str) -> Tensor:
        """What a folded layer reads for this weight (``ExportLayer._stored``): its placeholder,
        exported as ``openamct::Weight(key)``."""
        return placeholder_value(self, key)

    def placeholder(self) -> Tensor:
        """Right shape and dtype, zeros no page backs (what a trace computes with)."""
        shape = self.stored_shape
        if self.zeros is None:  # an export outside a streamed save: zeros of this weight's own
            self.zeros = ZeroPages()
        if self._placeholder is None or self._placeholder[1] != shape or not self.zeros.holds(self._placeholder[0]):
            self._placeholder = (self.zeros.view(shape, self.dtype), shape)  # (a Python tuple: no traced sizes)
        return self._placeholder[0]


class DeferredTable(DeferredWeight):
    """A large float table the model holds itself (an ``nn.Embedding``'s weight): written
    straight from the model's tensor, so neither the exporter nor its proto holds a copy."""

    def __init__(self, source: Tensor) -> None:
        super().__init__(None, tuple(source.shape))
        self.source = source

    @torch.no_grad()
    def compute(self, scratch: WriteScratch | None = None) -> Tensor:
        return self.source.detach().contiguous()


class WriteScratch:
    """Flat buffers, grown to the largest weight, reused for every layer a writer computes."""

    def __init__(self) -> None:
        self._flat: dict[tuple, Tensor] = {}

    def take(self, slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        n = math.prod(shape)
        flat = self._flat.get((slot, dtype))
        if flat is None or flat.numel() < n:
            self._flat.pop((slot, dtype), None)
            flat = self._flat[(slot, dtype)] = torch.empty(n, dtype=dtype)
        return flat[:n].view(shape)


class _Placeholder(Function):
    """Exports as ``openamct::Weight(key)`` with no input; the value is never exported. Its one
    tensor argument is a 1-element anchor: the trace records the placeholder itself as the
    output, so no weight-shaped constant enters the graph (a captured constant is made
    contiguous when the graph is converted: a full copy of every weight)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, key: str, deferred: DeferredWeight) -> Tensor:
        return deferred.placeholder()

    @staticmethod
    def symbolic(g, anchor, key: str, deferred: DeferredWeight):
        out = g.op(f"{PLACEHOLDER_DOMAIN}::{_PLACEHOLDER_OP}", key_s=key)
        out.setType(anchor.type().with_dtype(deferred.dtype).with_sizes(list(deferred.stored_shape)))
        return out


_ANCHOR = torch.zeros(1)


def placeholder_value(deferred: DeferredWeight, key: str) -> Tensor:
    """What a traced layer reads for its deferred weight ``key``."""
    return _Placeholder.apply(_ANCHOR, key, deferred)


class ZeroPages:
    """Per dtype one private anonymous mapping (``memory.zero_mapped``), grown to the largest
    placeholder: only read, its pages are the kernel's zero page, so placeholders add no RSS.
    One per export (``streamed_save``), released after its trace. Each tensor it gives carries
    it as ``_openamct_zeros``, so an op on a placeholder (``export_layer.zero_twin``) finds its owner."""

    def __init__(self) -> None:
        self.flat: dict[torch.dtype, Tensor] = {}
        self.twins = WeakIdKeyDictionary()
        # Every mapping made, kept until release: a placeholder made before the last growth
        # still reads one, and no other tensor can take its address meanwhile.
        self.kept: dict[int, Tensor] = {}

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        n = math.prod(shape)
        flat = self.flat.get(dtype)
        if flat is None or flat.numel() < n:
            flat = self.flat[dtype] = zero_mapped(torch.empty(n, dtype=dtype, device="meta"))
            self.kept[flat.untyped_storage().data_ptr()] = flat
        # A tensor of its own over the storage, not a view: the tracer fails on two views of
        # one base (two placeholders) that it never saw.
        out = torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), 0, shape)
        out._openamct_zeros = self
        return out

    def twin(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """Zeros of ``t``'s shape in ``dtype``, the same tensor for the same ``t``: made in the
        eager call before a trace, not inside it (one made in a traced Function's forward cost
        the deploy trace a float copy of every int8 weight: +0.9 W at 250M)."""
        out = self.twins.get(t)
        if out is None or out.dtype != dtype:
            out = self.twins[t] = self.view(tuple(t.shape), dtype)
        return out

    def holds(self, t: Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.kept

    def release(self) -> None:
        self.flat.clear()
        self.twins.clear()
        self.kept.clear()


class ExportEmbedding(nn.Module):
    """A plain ``nn.Embedding`` whose table reads as a placeholder (a ``DeferredTable``), so the writer
    writes it straight from the model's tensor: at 1.1B parameters it is 262 MB that the
    exporter, its proto and the writer each held once more."""

    def __init__(self, emb: nn.Embedding, path: str) -> None:
        nn.Module.__init__(self)
        for k, v in public_attrs(emb).items():  # num_embeddings, padding_idx, ...
            setattr(self, k, v)
        self._deferred, self._path = DeferredTable(emb.weight), path

    def __getattr__(self, name: str):
        d = self.__dict__.get("_deferred")
        if name == "weight" and d is not None:  # read by model code: dtype, shape (a trace), tying
            return torch.zeros((), dtype=d.dtype).expand(d.shape) if torch.jit.is_tracing() else d.source
        return super().__getattr__(name)

    def forward(self, ids: Tensor) -> Tensor:
        w = placeholder_value(self._deferred, f"{self._path}.weight")
        return F.embedding(ids, w, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq, self.sparse)


TABLE_MIN_BYTES = 1 << 20
_TABLES = (nn.Embedding, PooledGradEmbedding)  # the second is the first with a training backward of its own


def defer_tables(model: nn.Module) -> int:
    """Replace the plain float32 ``nn.Embedding`` tables of ``model`` (a working copy), 1 MB
    and up, by ``ExportEmbedding``; returns how many. Subclasses (a scaled embedding's own
    forward) and ``max_norm`` (renormalises the table in place) are left as they are."""
    found = [(n, m) for n, m in model.named_modules() if type(m) in _TABLES and m.max_norm is None
             and m.weight.dtype == torch.float32 and m.weight.numel() * 4 >= TABLE_MIN_BYTES and n]
    for name, m in found:
        set_module(model, name, as_layer_class(ExportEmbedding, nn.Embedding)(m, name))
    return len(found)


def deferred_weights(model: nn.Module) -> tuple[dict[str, DeferredWeight], list[str]]:
    """Each folded layer's deferred weight, by the name its placeholder exports under; and the
    order the exporter gives initializers (the state dict's, a deferred weight in the place of
    the parameter it replaces: its layer's first), so the file's order does not move."""
    found, order = {}, []
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, ExportLayer) and m._deferred is not None:
            found[prefix + m._wname] = m._deferred
            order.append(prefix + m._wname)
        if isinstance(m, ExportEmbedding):
            found[prefix + "weight"] = m._deferred
            order.append(prefix + "weight")
        order.extend(prefix + n for n, p in m._parameters.items() if p is not None)
        order.extend(prefix + n for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set)
    return found, order


def _is_placeholder(node: onnx.NodeProto) -> bool:
    return node.domain == PLACEHOLDER_DOMAIN and node.op_type == _PLACEHOLDER_OP


def bind_placeholders(model: onnx.ModelProto, deferred: dict[str, DeferredWeight]) -> dict[str, DeferredWeight]:
    """Name each placeholder node's output by its key (a layer called twice exports two nodes
    with one key: the second is dropped and its readers read the first). Returns the deferred
    weights the graph reads, in graph order; their nodes stay until the file is written."""
    g = model.graph
    rename, found, drop = {}, {}, []
    for node in g.node:
        if not _is_placeholder(node):
            continue
        key = onnx.helper.get_attribute_value(node.attribute[0]).decode()
        if key not in deferred:
            raise ValueError(f"export: the graph reads a folded weight {key!r} that no folded layer holds")
        rename[node.output[0]] = key
        if key in found:
            drop.append(node)
        else:
            found[key] = deferred[key]
            node.output[0] = key
    for node in drop:
        g.node.remove(node)
    for info in [v for v in g.value_info if v.name in rename]:  # the exporter's, under the old names
        g.value_info.remove(info)
    for node in g.node:
        node.input[:] = [rename.get(i, i) for i in node.input]
    for out in g.output:
        if out.name in rename:
            raise ValueError(f"export: a folded weight {rename[out.name]!r} is itself a model output")
    return found


def strip_placeholders(model: onnx.ModelProto) -> None:
    """Drop the placeholder nodes and their opset entry (the writer adds the initializers)."""
    g = model.graph
    for node in [n for n in g.node if _is_placeholder(n)]:
        g.node.remove(node)
    for entry in [o for o in model.opset_import if o.domain == PLACEHOLDER_DOMAIN]:
        model.opset_import.remove(entry)
