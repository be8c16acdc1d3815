"""INT8 quantization-aware training as a technique: an input-activation quantizer (ULQ) and a
weight quantizer (ARQ or ULQ) per planned layer, a foldable BatchNorm folded in, and an
output range observer for the deploy model.

Create and restore make the same structure from the plan and the graph: the numbers (clips)
come from the first batches (create) or the checkpoint (restore), never from the record,
which only reports them. The record gets each layer's scales at the first eval forward after
training and at save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from openamct.config.specs import ActSpec, LayerPlan, Plan, QuantSpec, WtsSpec
from openamct.module_tree import set_module
from openamct.quant.quantizers import ActULQ, WeightARQ, WeightULQ
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord, SingleLayerRecord
from openamct.techniques.base import Context, ExportParts, Technique


@dataclass(frozen=True)
class LayerQuantDecision:
    spec: QuantSpec
    fixed_min: bool
    share_key: tuple  # layers reading one tensor with the same settings share one quantizer
    bn: str | None  # the BatchNorm right after the layer, if it is the layer's only consumer


@dataclass
class QuantState:
    layers: dict[str, LayerQuantDecision]
    stored: dict[str, SingleLayerRecord] = field(default_factory=dict)  # restore: the record's scales


def make_act_quantizer(spec: ActSpec, fixed_min: bool, batch_num: int) -> ActULQ:
    if spec.clip_max is None:
        return ActULQ(fixed_min=fixed_min, batch_num=batch_num)
    return ActULQ(clip_max=spec.clip_max, clip_min=spec.clip_min, fixed_min=fixed_min, batch_num=batch_num)


def make_weight_quantizer(spec: WtsSpec) -> nn.Module:
    # The layout (axis, groups) is bound by CompressedLayer, which knows the weight shape.
    cls = WeightULQ if spec.algo == "ulq" else WeightARQ
    return cls(channel_wise=spec.channel_wise)


def _foldable(layer: nn.Module, bn: nn.Module) -> bool:
    out = getattr(layer, "out_channels", getattr(layer, "out_features", None))
    return isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.num_features == out and bn.track_running_stats


def _entry(layer: nn.Module) -> SingleLayerRecord | None:
    aq = getattr(layer, "act_quant", None)
    if aq is None or not bool(aq.initialized):
        return None
    scale_d, offset_d = aq.scale_offset()
    with torch.no_grad():
        scale_w = layer.weight_scales().reshape(-1).float().tolist()
    entry = SingleLayerRecord(scale_d=scale_d, offset_d=offset_d)
    entry.scale_w.extend(scale_w)
    entry.offset_w.extend([0] * len(scale_w))
    return entry


class Quantization(Technique):
    name = "quant"

    def planned(self, plan: Plan) -> list[LayerPlan]:
        return plan.quantized()

    def in_record(self, record: ScaleOffsetRecord) -> bool:
        return len(record.record) > 0

    def plan(self, ctx: Context) -> QuantState:
        """Structure only: which layers, with what settings, sharing which input quantizer."""
        decisions = {}
        for lp in self.planned(ctx.plan):
            act = lp.quant.act
            fixed = act.fixed_min if act.fixed_min is not None else ctx.graph.fed_by_relu(lp.name)
            src = ctx.graph.input_tensor(lp.name)
            bn = ctx.graph.single_bn_after(lp.name)
            call = ctx.graph.call_of(lp.name)
            if bn is not None and lp.type == "Linear" and len(call.outputs[0].shape) != 2:
                bn = None  # BatchNorm1d after a 3-D Linear output normalises another axis
            # One Q/DQ per tensor lets ONNX Runtime keep that tensor in int8 (see export).
            share = (src.key if src is not None else lp.name, act, bool(fixed))
            decisions[lp.name] = LayerQuantDecision(lp.quant, bool(fixed), share, bn)
        return QuantState(decisions)

    def from_record(self, ctx: Context) -> QuantState:
        state = self.plan(ctx)
        state.stored = {e.key: e.value for e in ctx.record.record}
        return state

    def check_restore(self, ctx: Context, state: QuantState) -> None:
        for key in state.stored:
            if key not in state.layers:
                raise ValueError(f"record_file has quantization scales for layer {key!r}, which this model and "
                                 "config do not quantize (record from another model or config?)")

    def apply(self, ctx: Context, state: QuantState) -> None:
        shared: dict[tuple, nn.Module] = {}
        for name, d in state.layers.items():
            module = ctx.model.get_submodule(name)
            parts = ctx.parts_of(name)
            aq = shared.get(d.share_key)
            if aq is None:
                aq = shared[d.share_key] = make_act_quantizer(d.spec.act, d.fixed_min, ctx.plan.batch_num)
            parts.act_quant = aq
            parts.wts_quant = make_weight_quantizer(d.spec.wts)
            parts.observe_output = True
            if d.bn is not None and _foldable(module, ctx.model.get_submodule(d.bn)):
                bn = parts.bn = ctx.model.get_submodule(d.bn)
                set_module(ctx.model, d.bn, nn.Identity().train(bn.training))

    def to_record(self, state: QuantState, layers, record: ScaleOffsetRecord) -> None:
        # Every compressed layer in wrapping order: the record lists entries as it always has.
        for name, layer in layers.items():
            entry = _entry(layer)
            if entry is None:
                entry = state.stored.get(name)
            if entry is not None:
                record.record.add(key=name).value.CopyFrom(entry)

    @torch.no_grad()
    def export_parts(self, layer: nn.Module, parts: ExportParts) -> None:
        if layer.act_quant is not None:
            parts.input_quant = layer.act_quant.scale_offset()
        if layer.wts_quant is not None:
            parts.weight_scales = layer.weight_scales()
            parts.weight_per_channel = bool(layer.wts_quant.channel_wise)
        obs = layer.out_observer
        if obs is not None and bool(obs.initialized):
            parts.output_range = (float(obs.min_val), float(obs.max_val))
