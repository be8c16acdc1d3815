"""INT8 quantizers on both inputs of the activation x activation matrix products in a quantized
model: attention's ``q @ k^T`` and ``softmax(...) @ v`` (openamct's own, switched on by the
retrain config's ``quantize_activation_matmul``; off by default).

Why: the deploy model's MatMul runs as an integer kernel in ONNX Runtime only when both inputs
are DequantizeLinear outputs (MatMulIntegerToFloat; QLinearMatMul when its output is quantized
too, which the deploy post-pass does where only quantized layers read it). quantize_static does
this from calibration ranges; here each input gets a trained ULQ clip (``quant/matmul.py``), so
the fake-quant file computes what the deploy file does. Off by default: the products' inputs are
where a transformer's precision is most fragile (a softmax row of many near-zero weights), and
switching it on changes every transformer user's model.

Which products: function calls ``matmul`` / ``bmm`` / ``@`` (torchvision Swin, HF BERT's eager
attention, most hand-written attention) whose two inputs are tensors the model computes (not
parameters or buffers: a product with a weight is a layer's job), inside a module's forward
(the innermost module the capture saw calling it, its owner); ``nn.MultiheadAttention`` is
replaced before capture by a module whose forward makes both products such calls
(``compressed/attention.py``). Not fused attention (``scaled_dot_product_attention``, an
``nn.MultiheadAttention`` left as it is): no MatMul to reach.
A product's first input made by a softmax (through dropout) lies in [0, 1]: its clip_min is
pinned at 0 (``fixed_min``), so all 256 levels cover [0, clip_max].

Create and restore build the same structure from the graph; the clips come from the first
``batch_num`` batches (create) or the checkpoint (restore). The record lists each owner as a
``selective_prune`` node tagged ``algorithm: matmul_quant`` with the positions of its products
among its matrix-product calls (``sites``) and the (scale, offset) of each quantizer; restore
refuses entries for modules it does not quantize, or for other positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from openamct.config.specs import LayerPlan, Plan
from openamct.graph.graph import Graph
from openamct.graph.node import Node
from openamct.quant.matmul import MATMUL_OPS, MatMulQuant, attach
from openamct.quant.quantizers import ActULQ
from openamct.record import attrs
from openamct.record.scale_offset_record_pb2 import AttrType, PruneRecord, ScaleOffsetRecord
from openamct.techniques.base import Context, Technique, selective_algorithm

logger = logging.getLogger(__name__)

ALGORITHM = "matmul_quant"
SOFTMAX = ("softmax", "Softmax")
PASS = ("dropout", "Dropout", "contiguous", "identity", "Identity")


@dataclass(frozen=True)
class Site:
    position: int  # among the owner's matrix-product calls in one forward
    unsigned_a: bool  # the first input is a softmax output: clip_min pinned at 0


@dataclass
class MatMulState:
    sites: dict[str, list[Site]]  # owner module -> its quantized products
    modules: dict[str, MatMulQuant] = field(default_factory=dict)  # filled by apply
    stored: dict[str, list[int]] = field(default_factory=dict)  # restore: the record's owners


def _is_product(n: Node) -> bool:
    return n.kind == "function" and n.op in MATMUL_OPS and len(n.inputs) == 2 and len(n.args) == 2


def _computed(n: Node) -> bool:
    """Both inputs are float tensors the forward computes or receives (parameters, buffers and
    constants have no producer)."""
    return all(t.producer is not None and t.dtype.is_floating_point for t in n.inputs)


def _from_softmax(t) -> bool:
    p = t.producer
    while p is not None and p.op in PASS and p.inputs:
        p = p.inputs[0].producer
    return p is not None and p.op in SOFTMAX


def find_sites(graph: Graph, model: nn.Module) -> dict[str, list[Site]]:
    """Owner module -> the activation x activation products of its forward (module docstring)."""
    products = [n for n in graph if _is_product(n)]
    owners = {n.scope for n in products if _computed(n) and n.scope}
    sites: dict[str, list[Site]] = {}
    for owner in sorted(owners):
        if owner in graph.module_calls:
            continue  # an opaque module's insides are not captured: its calls cannot be counted
        # positions among the products the owner's own code calls, as quant/matmul.py counts them
        own = [n for n in products if n.scope == owner]
        found = [Site(i, _from_softmax(n.inputs[0])) for i, n in enumerate(own) if _computed(n)]
        if found:
            sites[owner] = found
    return sites


def _owned(entry: PruneRecord) -> bool:
    return selective_algorithm(entry) == ALGORITHM


class MatMulQuantization(Technique):
    name = "matmul_quant"
    after = ("quant", "activation_quant")  # a model with quantized layers; the record lists it last

    def planned(self, plan: Plan) -> list[LayerPlan]:
        return plan.selected("quant")  # no config slice of its own: it follows the quantized layers


    def owns(self, entry: PruneRecord) -> bool:
        return _owned(entry)

    def plan(self, ctx: Context) -> MatMulState:
        if not ctx.plan.activation_matmul:  # the config's switch (off: nothing, no record entry)
            return MatMulState({})
        sites = find_sites(ctx.graph, ctx.model)
        logger.debug("activation x activation MatMuls: %d in %d modules",
                     sum(len(s) for s in sites.values()), len(sites))
        return MatMulState(sites)

    def from_record(self, ctx: Context) -> MatMulState:
        state = self.plan(ctx)
        for pr in ctx.record.prune_record:
            if _owned(pr):
                state.stored[pr.selective_prune.name] = list(attrs.get_ints(pr.selective_prune, "sites") or [])
        return state

    def check_restore(self, ctx: Context, state: MatMulState) -> None:
        for name, positions in sorted(state.stored.items()):
            if name not in state.sites:
                raise ValueError(f"record_file has MatMul input quantizers for module {name!r}, which this model "
                                 "and config do not quantize (record from another model or config? the config's "
                                 "quantize_activation_matmul must be as at create)")
            if positions != [s.position for s in state.sites[name]]:
                raise ValueError(f"record_file: module {name!r} has its MatMul input quantizers at products "
                                 f"{positions}, this model at {[s.position for s in state.sites[name]]}")

    def apply(self, ctx: Context, state: MatMulState) -> None:
        batch_num = ctx.plan.batch_num

        def q(owner: str, what: str, fixed_min: bool = False) -> ActULQ:
            aq = ActULQ(fixed_min=fixed_min, batch_num=batch_num)
            aq.layer_name = f"{owner} ({what})"  # for its error messages
            return aq

        for owner, sites in state.sites.items():
            q_a = [q(owner, f"MatMul {s.position} input A", s.unsigned_a) for s in sites]
            q_b = [q(owner, f"MatMul {s.position} input B") for s in sites]
            quant = MatMulQuant([s.position for s in sites], q_a, q_b)
            module = ctx.model.get_submodule(owner)
            quant.train(module.training)
            attach(module, quant)
            state.modules[owner] = quant

    def to_record(self, state: MatMulState, layers, record: ScaleOffsetRecord) -> None:
        for name, quant in state.modules.items():
            qs = quant.quantizers()
            if not all(bool(q.initialized) for q in qs.values()):
                continue
            node = record.prune_record.add().selective_prune
            node.name = name
            attrs.add_str(node, "algorithm", ALGORITHM)
            attrs.add_str(node, "op", "matmul")
            attrs.add_ints(node, "sites", list(quant.sites))
            node.attr.add(name="quantizers", type=AttrType.STRINGS, strings=[k.encode() for k in qs])
            pairs = [q.scale_offset() for q in qs.values()]
            node.attr.add(name="scale_d", type=AttrType.FLOATS, floats=[s for s, _ in pairs])
            attrs.add_ints(node, "offset_d", [o for _, o in pairs])
