"""INT8 quantizers on the tensors between layers: a Sigmoid, SiLU, Hardswish or Hardsigmoid
module right after a quantized layer (through its folded BatchNorm) becomes a
``QuantizedActivation`` (ORT runs the hard ones in float between their Q/DQ, as quantize_static's
graph does; their quantized output lets the pools and multiplies after them run in int8).

Why: ONNX Runtime has integer kernels for Sigmoid and Mul (QLinearSigmoid, QLinearMul) but runs
them only when each is DQ -> op -> Q. Left float, the layer before them also lacks the output
quantizer QLinearConv needs, and the deploy writer fell back to an output-observer range the
fake-quant model does not have (EfficientNet: 65 float Sigmoid + 65 float Mul; deploy drifted from
fake-quant). With these quantizers in the training model, trained and initialised like every
ULQ input clip, the fake-quant file reproduces what the deploy file computes.

Settings follow the producing layer: it must be planned for quantization; the clips are
initialised from the first ``batch_num`` batches like its own. The op's output gets a quantizer
only when no quantized layer reads it (those quantize it themselves; two quantizers in a row
would round twice) and an op ORT runs in int8 does, looking through constant-zero padding and
Dropout/Identity/Flatten/Reshape.

A quantized conv whose output (after its folded BN) only such ops read (a residual Add, also an
in-place one, the average pool before a classifier, concat), or only quantized layers and
residual Adds, gets an output quantizer (``LayerParts.out_quant``) for the same reason: in the
second case the readers' own input quantizer, which they then do not apply again (one grid, so
ORT runs no requantizing Q/DQ pair between a block's last conv and the next block; also through
an ``nn.Identity`` activation or a ``Dropout(p=0)``, timm's ConvNormAct). A tensor no layer
produces that a quantized layer and residual Adds read (a block's output, a ReLU module's, a
wrapped activation's) gets that layer's input quantizer through a forward hook on the module
returning it (``quant/residual.py``), and so does every module returning an input of a concat
that quantized layers read (``concat_sites.py``). A conv's ReLU output only float ops read: ``conv_outputs.py``.

Create and restore build the same structure from the plan and the graph; the clips come from
the first batches (create) or the checkpoint (restore), as for ``Quantization``. The record lists
each wrapped module as a ``selective_prune`` node tagged ``algorithm: activation_quant`` with the
(scale, offset) of each quantizer, and restore refuses entries for modules it does not wrap.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from openamct.config.specs import LayerPlan, Plan
from openamct.graph.graph import Graph
from openamct.module_tree import set_module
from openamct.quant.activation import QuantizedActivation
from openamct.quant.quantizers import ActULQ
from openamct.quant.residual import OutputQuantHook
from openamct.record import attrs
from openamct.record.scale_offset_record_pb2 import AttrType, PruneRecord, ScaleOffsetRecord
from openamct.techniques.base import Context, ExportParts, Technique, selective_algorithm
from openamct.techniques.concat_sites import (
    ConcatSite,
    concat_sites,
    hook_sites,
    hooked_tensors,
    record_sites,
)
from openamct.techniques.conv_outputs import hook_relus, norm_read_convs, relu_sites
from openamct.techniques.tensor_readers import (
    ACTIVATION_FUNCTIONS,
    conv_layers,
    int8_reader,
    layer_output,
    passes,
    producer_layer,
    readers,
    residual_readers,
    residual_sites,
    same_values,
)

logger = logging.getLogger(__name__)

ALGORITHM = "activation_quant"
# (module, name) of an activation class -> QuantizedActivation kind. Exact classes only: a
# subclass may compute something else. Capture records torch's as one module node, and looks
# into parameter-free classes from elsewhere: HF's SiLUActivation (MobileViT's "silu") is a
# ``silu`` function node scoped to the module, whose whole forward it is.
KIND_OF = {("torch.nn.modules.activation", "SiLU"): "silu",
           ("torch.nn.modules.activation", "Sigmoid"): "sigmoid",
           ("transformers.activations", "SiLUActivation"): "silu",
           ("torch.nn.modules.activation", "Hardswish"): "hardswish",  # (torchvision's MobileNetV3)
           ("torch.nn.modules.activation", "Hardsigmoid"): "hardsigmoid"}


def _activation(model: nn.Module, graph: Graph, node) -> tuple[str, str] | None:
    """(module path, kind) when ``node`` is the one call of an activation module we wrap."""
    if node.kind == "module" and graph.call_of(node.name) is node:
        path = node.name
    elif node.kind == "function" and node.scope and node.op in ACTIVATION_FUNCTIONS:
        path = node.scope
    else:
        return None
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        return None
    cls = type(model.get_submodule(path))  # not node.op: an earlier technique may have replaced it
    kind = KIND_OF.get((cls.__module__, cls.__name__))
    if kind is None or node.kind == "function" and kind != node.op:
        return None
    return path, kind



@dataclass(frozen=True)
class ActDecision:
    kind: str
    producer: str  # the quantized layer whose output this op reads
    quantize_output: bool


@dataclass
class ActState:
    ops: dict[str, ActDecision]
    outputs: list[str] = field(default_factory=list)  # conv layers given an output quantizer
    # those of them whose output only quantized layers and residual Adds read -> those layers:
    # the output quantizer is theirs (one grid, no requantize between them)
    shared: dict[str, list[str]] = field(default_factory=dict)
    # module whose output a layer and residual Adds read -> those layers (quant/residual.py)
    residual: dict[str, list[str]] = field(default_factory=dict)
    hooked: dict[str, nn.Module] = field(default_factory=dict)  # filled by apply: module -> quantizer
    modules: dict[str, QuantizedActivation] = field(default_factory=dict)  # filled by apply
    concats: dict[str, ConcatSite] = field(default_factory=dict)  # concat_sites.py
    concat_hooked: dict[str, nn.Module] = field(default_factory=dict)  # filled by apply: site -> quantizer
    relus: dict[str, str] = field(default_factory=dict)  # ReLU module -> conv (conv_outputs.py)
    relu_hooked: dict[str, nn.Module] = field(default_factory=dict)  # filled by apply: module -> quantizer
    stored: set[str] = field(default_factory=set)  # restore: the record's module names
    # restore: the record's output quantizer scale of each shared conv, and its readers' input scale
    stored_shared: dict[str, tuple[float, list[float]]] = field(default_factory=dict)



def _entry(record: ScaleOffsetRecord, name: str, op: str):
    """A new ``selective_prune`` node of this technique for module ``name``."""
    node = record.prune_record.add().selective_prune
    node.name = name
    attrs.add_str(node, "algorithm", ALGORITHM)
    attrs.add_str(node, "op", op)
    return node


def _owned(entry: PruneRecord) -> bool:
    return selective_algorithm(entry) == ALGORITHM


class ActivationQuant(Technique):
    name = "activation_quant"
    after = ("quant",)  # it follows the quantized layers and shares their input quantizers
    FOLLOWS = "quant"  # the technique whose planned layers it follows (no config slice of its own)

    def planned(self, plan: Plan) -> list[LayerPlan]:
        return plan.selected(self.FOLLOWS)  # the graph says which ops

    def owns(self, entry: PruneRecord) -> bool:
        return _owned(entry)

    def plan(self, ctx: Context) -> ActState:
        planned = {lp.name for lp in self.planned(ctx.plan)}
        found = [(node, *a) for node in ctx.graph if (a := _activation(ctx.model, ctx.graph, node)) is not None]
        calls = collections.Counter(path for _, path, _ in found)
        ops = {}
        for node, path, kind in found:
            if calls[path] > 1:
                continue  # a module called twice sees two distributions: left float
            producer = producer_layer(ctx.graph, node.inputs[0], planned)
            if producer is None:
                continue
            r = readers(ctx.graph, node.outputs[0], planned, ctx.model)
            if r["layer"] and (r["int8"] or r["other"]):
                logger.debug("%s: read by quantized layers and other ops; its output stays float there", path)
            ops[path] = ActDecision(kind, producer, quantize_output=not r["layer"] and r["int8"] > 0)
        # Conv outputs that only int8 ops read (a residual Add, the pool before the classifier):
        # an output quantizer, so QLinearConv has its output scale from training, not from a
        # range observer the fake-quant model does not have.
        residual = residual_sites(ctx.graph, planned, set(ops), conv_layers(self.planned(ctx.plan)), ctx.model)
        concats = concat_sites(ctx.graph, planned, planned | set(ops) | set(residual), ctx.model)
        hooked = hooked_tensors(ctx.graph, concats)  # a concat's input hook quantizes these
        # ... and a residual site's hook these: a conv whose output (through an Identity) is one
        # needs no quantizer of its own (two in a row round twice, and ORT merges the pair)
        on_sites = {k for k, m in ctx.graph.module_outputs.items() if m in residual}
        outputs, rest, shared = [], {}, {}
        convs = conv_layers(self.planned(ctx.plan))
        for lp in self.planned(ctx.plan):
            if not lp.type.startswith("Conv") or lp.type.startswith("ConvTranspose"):
                continue
            t = layer_output(ctx.graph, lp.name)
            if t is None or t.key in hooked:
                continue
            if any(u.key in on_sites for u in same_values(ctx.graph, t, ctx.model)):
                continue
            rest[lp.name] = t
            r = readers(ctx.graph, t, planned, ctx.model, set(ops))
            # Also when quantized layers read it too but the int8 ops are residual Adds: the
            # deploy model's QLinearAdd needs this tensor quantized, and without a quantizer of
            # its own the deploy writer would use the next layer's input quantizer, which the
            # fake-quant model does not apply to the Add (MNIST SE net: 90.9 vs 90.5 %).
            if r["int8"] and not r["other"] and (not r["layer"] or r["add"] == r["int8"]):
                outputs.append(lp.name)
                del rest[lp.name]
                if r["layer"] and (layers := residual_readers(ctx.graph, t, planned, convs, ctx.model)):
                    shared[lp.name] = layers
        # The rest: a ReLU output only float ops read gets a trained quantizer (conv_outputs.py)
        wrapped = set(ops)
        taken = wrapped | set(residual) | {m for s in concats.values() for m in (*s.inputs, s.output) if m}

        def reads_quantized(n, t) -> bool:
            wraps = n.name in wrapped or n.kind == "function" and n.scope in wrapped and n.op in ACTIVATION_FUNCTIONS
            return bool((n.kind == "module" and n.name in planned or wraps) and n.inputs and n.inputs[0] is t)

        done = hooked | {k for k, m in ctx.graph.module_outputs.items() if m in residual}
        relus = relu_sites(ctx.graph, rest, taken, done, reads_quantized, passes,
                           lambda n: int8_reader(ctx.model, n) and n.op in ("add", "mul", "cat"))
        outputs += norm_read_convs(ctx.graph, rest, done, passes, ctx.model)
        return ActState(ops, outputs=outputs, shared=shared, residual=residual, concats=concats, relus=relus)

    def from_record(self, ctx: Context) -> ActState:
        state = self.plan(ctx)
        state.stored = {pr.selective_prune.name for pr in ctx.record.prune_record if _owned(pr)}
        layer_scales = {e.key: e.value.scale_d for e in ctx.record.record if e.value.HasField("scale_d")}
        for pr in ctx.record.prune_record:
            node = pr.selective_prune
            if _owned(pr) and node.name in state.shared and attrs.get_str(node, "op") == "output":
                own = next((list(a.floats) for a in node.attr if a.name == "scale_d"), [])
                theirs = [layer_scales[n] for n in state.shared[node.name] if n in layer_scales]
                if own and theirs:
                    state.stored_shared[node.name] = (own[0], theirs)
        return state

    def check_restore(self, ctx: Context, state: ActState) -> None:
        known = set(state.ops) | set(state.outputs) | set(state.residual) | set(state.concats) | set(state.relus)
        for name in sorted(state.stored - known):
            raise ValueError(f"record_file has activation quantizers for module {name!r}, which this model and "
                             "config do not quantize (record from another model or config?)")
        for name, (own, theirs) in sorted(state.stored_shared.items()):
            if any(r != own for r in theirs):
                raise ValueError(
                    f"record_file gives layer {name!r} an output quantizer of its own (scale {own:g}), where this "
                    f"version of openamct shares its readers' input quantizer ({state.shared[name]}, scale "
                    f"{theirs[0]:g}): the record and checkpoint come from an earlier version; create the model "
                    "again and retrain")

    def apply(self, ctx: Context, state: ActState) -> None:
        batch_num = ctx.plan.batch_num
        for name, d in state.ops.items():
            def q(fixed_min: bool, what: str, name: str = name) -> ActULQ:
                aq = ActULQ(fixed_min=fixed_min, batch_num=batch_num)
                aq.layer_name = f"{name} ({what})"  # for its error messages
                return aq
            sig_out = q(True, "gate output")  # (hard) sigmoid >= 0: clip_min pinned at 0
            if d.kind in ("silu", "hardswish"):  # x * gate(x): the gate's output is quantized too
                wrapper = QuantizedActivation(d.kind, q(False, "input"), sig_out,
                                              q(False, "output") if d.quantize_output else None)
            else:
                wrapper = QuantizedActivation(d.kind, q(False, "input"), None,
                                              sig_out if d.quantize_output else None)
            wrapper.train(ctx.model.get_submodule(name).training)
            set_module(ctx.model, name, wrapper)
            state.modules[name] = wrapper
        for name in state.outputs:
            readers = [ctx.parts_of(n) for n in state.shared.get(name, ())]
            qs = {id(p.act_quant): p.act_quant for p in readers}
            if len(qs) == 1 and None not in qs.values():
                (aq,) = qs.values()
                for p in readers:
                    p.input_on_grid = True
            else:
                aq = ActULQ(fixed_min=False, batch_num=batch_num)
                aq.layer_name = f"{name} (output)"
            ctx.parts_of(name).out_quant = aq
        for name, layers in state.residual.items():
            qs = {id(ctx.parts_of(n).act_quant): ctx.parts_of(n).act_quant for n in layers}
            if len(qs) != 1 or None in qs.values():
                logger.debug("%s: its readers %s do not share one input quantizer; output left float", name, layers)
                continue
            (aq,) = qs.values()
            ctx.model.get_submodule(name).register_forward_hook(OutputQuantHook(aq))
            for n in layers:
                ctx.parts_of(n).input_on_grid = True
            state.hooked[name] = aq
        state.concat_hooked = hook_sites(ctx.model, state.concats, ctx.parts_of, batch_num)
        state.relu_hooked = hook_relus(ctx.model, state.relus, batch_num)

    def to_record(self, state: ActState, layers, record: ScaleOffsetRecord) -> None:
        found = [(n, w.kind, w.quantizers()) for n, w in state.modules.items()]
        found += [(n, "output", {"q_out": layers[n].out_quant}) for n in state.outputs if n in layers]
        found += [(n, "relu_output", {"q_out": aq}) for n, aq in state.relu_hooked.items()]
        for name, op, qs in found:
            if not all(bool(q.initialized) for q in qs.values()):
                continue
            node = _entry(record, name, op)
            node.attr.add(name="quantizers", type=AttrType.STRINGS, strings=[k.encode() for k in qs])
            pairs = [q.scale_offset() for q in qs.values()]
            node.attr.add(name="scale_d", type=AttrType.FLOATS, floats=[s for s, _ in pairs])
            attrs.add_ints(node, "offset_d", [o for _, o in pairs])
        for name, aq in state.hooked.items():
            if not bool(aq.initialized):
                continue
            node = _entry(record, name, "residual")  # the quantizer is the reading layers' input one
            node.attr.add(name="layers", type=AttrType.STRINGS, strings=[n.encode() for n in state.residual[name]])
        record_sites(state.concats, state.concat_hooked, lambda name, op: _entry(record, name, op))


    @torch.no_grad()
    def export_parts(self, layer: nn.Module, parts: ExportParts) -> None:
        if getattr(layer, "out_quant", None) is not None:
            parts.output_quant = layer.out_quant.scale_offset()
