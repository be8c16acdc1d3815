"""Folded weights that are computed when they are written, not held (issue 19).

Holding every layer's folded weight at once costs a second copy of the model while a save
runs (the fake-quant model's float weights: 1 W; the deploy model's int8: 0.25 W, plus the
exporter's proto of them and its serialised copy). So a folded layer keeps a
``DeferredWeight`` instead: it knows how to compute the weight from the compressed layer, and
only shape and dtype otherwise.

- Eager calls (``export_signature``'s probe, or a user running the folded module) compute the
  real weight, so the folded module stays a correct torch module.
- While the exporter traces, the layer reads ``placeholder``: a zero-stride tensor of the right
  shape, holding one element, that exports as a node ``openamct::Weight(key=<name>)``. The
  exporter never sees the values, so it neither copies nor serialises them.
- ``bind_placeholders`` renames each such node's output to the initializer name the file has
  always used (``<layer>.weight``, ``.weight_t``, ``.weight_int8``): the deploy post-pass keys
  its observers by it.
- The staging writer (``staging.stage_streamed``) computes and writes one weight at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
import torch
from torch import Tensor
from torch.autograd import Function

__all__ = ["DeferredWeight", "placeholder_value", "bind_placeholders", "strip_placeholders", "PLACEHOLDER_DOMAIN"]

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
    _placeholder: Tensor | None = field(default=None, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.quantize is None else torch.int8

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transposed else self.shape

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.stored_shape:
            n *= d
        return n * (1 if self.dtype == torch.int8 else 4)

    @torch.no_grad()
    def compute(self) -> Tensor:
        """The stored tensor, contiguous: what the file holds under this layer's weight name."""
        w, _ = self.layer.effective_weight_bias()
        if self.layer.kind == "linear_t":
            w = w.t()
        w = w.detach().float()
        if self.quantize is not None:
            return self.quantize.quantize(w).contiguous()
        return w.t().contiguous() if self.transposed else w.contiguous()

    def placeholder(self) -> Tensor:
        """Right shape and dtype, one element of storage (what a trace computes with)."""
        shape = self.stored_shape
        if self._placeholder is None or tuple(self._placeholder.shape) != shape:
            self._placeholder = torch.zeros((), dtype=self.dtype).expand(shape)
        return self._placeholder


class _Placeholder(Function):
    """Exports as ``openamct::Weight(key)`` with no input; the value is never exported."""

    @staticmethod
    def forward(ctx, anchor: Tensor, key: str) -> Tensor:
        return anchor

    @staticmethod
    def symbolic(g, anchor, key: str):
        out = g.op(f"{PLACEHOLDER_DOMAIN}::{_PLACEHOLDER_OP}", key_s=key)
        out.setType(anchor.type())
        return out


def placeholder_value(deferred: DeferredWeight, key: str) -> Tensor:
    """What a traced layer reads for its deferred weight ``key``."""
    return _Placeholder.apply(deferred.placeholder(), key)


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
