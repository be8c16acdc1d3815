"""Quantization-aware training as a technique: an input-activation quantizer (ULQ) and a
weight quantizer (ARQ or ULQ) per planned layer, a foldable BatchNorm folded in, and an
output range observer for the deploy model.

Formats (``openamct.formats``): the config's ``dst_type`` names them, and a layer takes the
pair of them only as ``formats.PAIRS`` lists it for its type: A8W8 (the default) and A8W4 on
every type, A16W8 on LSTM/GRU; A4W4 and A4W8 are refused with upstream's reason. The record
names a format other than INT8 in ``act_type`` / ``wts_type`` (INT8 is the proto default and
is never written).

Create and restore make the same structure from the plan and the graph: the numbers (clips)
come from the first batches (create) or the checkpoint (restore), never from the record,
which only reports them. The record gets each layer's scales at the first eval forward after
training and at save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from openamct.compressed.recurrent import RecurrentLayer, record_keys, unsupported
from openamct.config.errors import ConfigError, locate
from openamct.config.retrain_config_pb2 import DataType
from openamct.config.rules import QUANT, f32, winning_block
from openamct.formats import (
    ACTIVATION_FORMATS,
    DEFAULT,
    REFUSED_PAIRS,
    WEIGHT_FORMATS,
    QuantFormat,
    activation_format,
    format_pair,
    pair_name,
    weight_format,
)
from openamct.layer_types import ALL_TYPES, LAYER_TYPES
from openamct.module_tree import set_module
from openamct.quant.quantizers import ActULQ, WeightARQ, WeightULQ
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord, SingleLayerRecord
from openamct.techniques.base import Context, ExportParts, Technique

# -- the config slice: what the plan holds for one quantized layer -------------------------

@dataclass(frozen=True)
class ActSpec:
    """ULQ input-activation quantization. ``fixed_min=None`` means: pin clip_min at 0 when the
    layer's input comes from a ReLU (decided from the graph)."""

    clip_max: float | None = None
    clip_min: float | None = None
    fixed_min: bool | None = None
    dst_type: str = "INT8"  # a name of openamct.formats.ACTIVATION_FORMATS

    @property
    def format(self) -> QuantFormat:
        return activation_format(self.dst_type)


@dataclass(frozen=True)
class WtsSpec:
    algo: str = "arq"  # "arq" | "ulq"
    channel_wise: bool = True
    dst_type: str = "INT8"  # a name of openamct.formats.WEIGHT_FORMATS

    @property
    def format(self) -> QuantFormat:
        """The weight format, with this layer's granularity."""
        return weight_format(self.dst_type, self.channel_wise)


@dataclass(frozen=True)
class QuantSpec:
    act: ActSpec
    wts: WtsSpec


_DTYPE = {v: k for k, v in DataType.items()}


def _check_dtype(value: int, field: str, where: str, text: str, src: str, weights: bool) -> None:
    name = _DTYPE.get(value, str(value))
    allowed = WEIGHT_FORMATS if weights else ACTIVATION_FORMATS
    if name in allowed:
        return
    at = f"{src}: {locate(text, 'dst_type', name)}{where}.{field}: "
    if name in WEIGHT_FORMATS:
        why = REFUSED_PAIRS.get(pair_name(name, DEFAULT), "")
        raise ConfigError(f"{at}{name} is for weights only (retrain_weight_quant_config); "
                          f"activations are quantized as {', '.join(ACTIVATION_FORMATS)}. {why}")
    raise ConfigError(f"{at}{name} is not supported; use one of {', '.join(allowed)}")


def read_spec(block, layer_type: str) -> QuantSpec | None:
    """The QuantSpec a config block gives a layer of ``layer_type``; a missing half (data or
    weights) takes the defaults (ULQ / ARQ), never another block's half."""
    has_d, has_w = block.HasField("retrain_data_quant_config"), block.HasField("retrain_weight_quant_config")
    if not (has_d or has_w):
        return None
    act = ActSpec()
    if has_d and block.retrain_data_quant_config.HasField("ulq_quantize"):
        u = block.retrain_data_quant_config.ulq_quantize
        clips = (f32(u.clip_max_min.clip_max), f32(u.clip_max_min.clip_min)) if u.HasField("clip_max_min") else (None, None)
        act = ActSpec(clip_max=clips[0], clip_min=clips[1],
                      fixed_min=u.fixed_min if u.HasField("fixed_min") else None,
                      dst_type=_DTYPE.get(u.dst_type, DEFAULT))
    wts = WtsSpec(channel_wise=layer_type != "Linear")
    if has_w:
        algo = block.retrain_weight_quant_config.WhichOneof("wts_algo") or "arq_retrain"
        w = getattr(block.retrain_weight_quant_config, algo)
        cw = w.channel_wise if w.HasField("channel_wise") else layer_type != "Linear"
        wts = WtsSpec(algo="ulq" if algo == "ulq_retrain" else "arq", channel_wise=cw,
                      dst_type=_DTYPE.get(w.dst_type, DEFAULT))
    return QuantSpec(act, wts)


def check_pair(spec: QuantSpec | None, info) -> QuantSpec | None:
    """``spec`` when its activation/weight pair is one its layer's type takes (``formats.PAIRS``);
    else a ConfigError naming the layer, both dst_type fields and the reason."""
    if spec is not None:
        where = (f"layer {info.name!r} ({info.type}): retrain_data_quant_config.ulq_quantize.dst_type "
                 f"{spec.act.dst_type} / retrain_weight_quant_config.dst_type {spec.wts.dst_type}")
        try:
            format_pair(spec.act.dst_type, spec.wts.dst_type, info.type, where)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return spec


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
        return ActULQ(fixed_min=fixed_min, batch_num=batch_num, fmt=spec.format)
    return ActULQ(clip_max=spec.clip_max, clip_min=spec.clip_min, fixed_min=fixed_min, batch_num=batch_num,
                  fmt=spec.format)


def make_weight_quantizer(spec: WtsSpec) -> nn.Module:
    # The layout (axis, groups) is bound by CompressedLayer, which knows the weight shape.
    cls = WeightULQ if spec.algo == "ulq" else WeightARQ
    return cls(channel_wise=spec.channel_wise, fmt=spec.format)


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
    # INT8, the field's default, stays unwritten: INT8 records keep their bytes.
    if aq.format.name != DEFAULT:
        entry.act_type = aq.format.name
    wfmt = layer.wts_quant.format
    if wfmt.name != DEFAULT:
        entry.wts_type = wfmt.name
    return entry


def _recurrent_entries(name: str, layer: RecurrentLayer) -> list[tuple[str, SingleLayerRecord]]:
    """One entry per (layer, direction): input (``scale_d``), hidden state (``scale_h``), and the
    per-row scales of ``weight_ih`` (``scale_w``) and ``weight_hh`` (``scale_r``), upstream's
    record fields for recurrent layers. None until every activation quantizer has its clips."""
    if layer.quantizers_pending():
        return []
    out = []
    for key, sfx in zip(record_keys(name, layer.num_layers, layer.bidirectional), layer.suffixes):
        xq, hq = layer.x_quant[sfx.split("_")[0]], layer.h_quant[sfx]
        (scale_d, offset_d), (scale_h, offset_h) = xq.scale_offset(), hq.scale_offset()
        entry = SingleLayerRecord(scale_d=scale_d, offset_d=offset_d, scale_h=scale_h, offset_h=offset_h)
        sw = layer.weight_scales(f"weight_ih_{sfx}").reshape(-1).float().tolist()
        sr = layer.weight_scales(f"weight_hh_{sfx}").reshape(-1).float().tolist()
        entry.scale_w.extend(sw)
        entry.offset_w.extend([0] * len(sw))
        entry.scale_r.extend(sr)
        entry.offset_r.extend([0] * len(sr))
        if xq.format.name != DEFAULT:
            entry.act_type = xq.format.name
        wfmt = layer.wts_quant[f"weight_ih_{sfx}"].format
        if wfmt.name != DEFAULT:
            entry.wts_type = wfmt.name
        out.append((key, entry))
    return out


def _keys(name: str, info) -> list[str]:
    """The record keys of a planned layer (a recurrent layer has one per layer and direction)."""
    if not LAYER_TYPES[info.type].recurrent:
        return [name]
    return record_keys(name, info.module.num_layers, info.module.bidirectional)


MAX_POOLS = {("module", "MaxPool1d"), ("module", "MaxPool2d"), ("module", "MaxPool3d"),
             ("function", "max_pool1d"), ("function", "max_pool2d"), ("function", "max_pool3d")}


def _pooled_from(t):
    """The tensor ``t`` max-pools (through max pools), else ``t``: a layer reading max_pool(x)
    shares the input quantizer of the layers reading x. Max pooling commutes with a monotone
    quantizer, so the deploy model pools the uint8 tensor (ORT runs DQ -> MaxPool -> Q of one
    qparams as a uint8 MaxPool) and fake-quant computes the same values (GoogLeNet's pool
    branches, which read the tensor the other branches' convs read)."""
    p = t.producer
    while p is not None and (p.kind, p.op) in MAX_POOLS and len(p.inputs) == 1 and len(p.outputs) == 1:
        t, p = p.inputs[0], p.inputs[0].producer
    return t


class Quantization(Technique):
    name = "quant"
    after = ("filter_prune",)  # a foldable BatchNorm is folded as channel pruning left it
    family = QUANT
    layer_types = ALL_TYPES  # every layer type of the table


    def plan_from_json(self, raw: bytes, layers, src: str):
        """A plan from the QAT family's JSON config (``techniques/quant_json.py``)."""
        from openamct.techniques.quant_json import plan_from_json

        return plan_from_json(raw, layers, src, self.name, tuple(self.layer_types))
    def eligible(self, info) -> str | None:
        why = super().eligible(info)
        if why is None and LAYER_TYPES[info.type].recurrent:
            why = unsupported(info.module)  # (an LSTM with proj_size stays float, with this note)
        return why

    def configured_by(self, block) -> bool:
        return QUANT.present(block)

    def validate_block(self, b, where: str, text: str, src: str) -> None:
        if b.HasField("retrain_data_quant_config"):
            d = b.retrain_data_quant_config
            if d.HasField("ulq_quantize"):
                u = d.ulq_quantize
                _check_dtype(u.dst_type, "retrain_data_quant_config.ulq_quantize.dst_type", where, text, src,
                             weights=False)
                if u.HasField("clip_max_min"):
                    cmax, cmin = u.clip_max_min.clip_max, u.clip_max_min.clip_min
                    if not (math.isfinite(cmax) and cmax > 0):
                        raise ConfigError(f"{src}: {locate(text, 'clip_max')}{where}: clip_max must be a finite number > 0, got {cmax}")
                    if not (math.isfinite(cmin) and cmin < 0):
                        raise ConfigError(f"{src}: {locate(text, 'clip_min')}{where}: clip_min must be a finite number < 0, got {cmin}")
        if b.HasField("retrain_weight_quant_config"):
            w = b.retrain_weight_quant_config
            algo = w.WhichOneof("wts_algo")
            if algo is not None:
                _check_dtype(getattr(w, algo).dst_type, f"retrain_weight_quant_config.{algo}.dst_type", where, text, src,
                             weights=True)

    def layer_spec(self, cfg, info, api: str, notes: list[str]) -> QuantSpec | None:
        if self.eligible(info) is not None:
            return None
        block, skipped = winning_block(cfg, QUANT, info.name, info.type)
        if block is not cfg and block is not None:
            return check_pair(read_spec(block, info.type), info)  # an override re-enables a skipped layer
        if skipped:
            notes.append("quant: skipped")
            return None
        spec = read_spec(cfg, info.type)
        if spec is None and api == "quant":  # upstream's QAT family quantizes by default
            spec = QuantSpec(ActSpec(), WtsSpec(channel_wise=info.type != "Linear"))
        return check_pair(spec, info)

    def in_record(self, record: ScaleOffsetRecord) -> bool:
        return len(record.record) > 0

    def plan(self, ctx: Context) -> QuantState:
        """Structure only: which layers, with what settings, sharing which input quantizer."""
        decisions = {}
        for lp in self.planned(ctx.plan):
            spec = lp.specs[self.name]
            act = spec.act
            fixed = act.fixed_min if act.fixed_min is not None else ctx.graph.fed_by_relu(lp.name)
            src = ctx.graph.input_tensor(lp.name)
            # A recurrent layer folds no BatchNorm (its outputs are a sequence and states).
            bn = None if LAYER_TYPES[lp.type].recurrent else ctx.graph.single_bn_after(lp.name)
            call = ctx.graph.call_of(lp.name)
            if bn is not None and lp.type == "Linear" and len(call.outputs[0].shape) != 2:
                bn = None  # BatchNorm1d after a 3-D Linear output normalises another axis
            # One Q/DQ per tensor lets ONNX Runtime keep that tensor in int8 (see export).
            src = _pooled_from(src) if src is not None else None
            share = (src.key if src is not None else lp.name, act, bool(fixed))
            decisions[lp.name] = LayerQuantDecision(spec, bool(fixed), share, bn)
        return QuantState(decisions)

    def from_record(self, ctx: Context) -> QuantState:
        state = self.plan(ctx)
        state.stored = {e.key: e.value for e in ctx.record.record}
        return state

    def check_restore(self, ctx: Context, state: QuantState) -> None:
        owner = {k: name for name in state.layers for k in _keys(name, ctx.layers[name])}
        for key, entry in state.stored.items():
            if key not in owner:
                raise ValueError(f"record_file has quantization scales for layer {key!r}, which this model and "
                                 "config do not quantize (record from another model or config?)")
            spec = state.layers[owner[key]].spec
            for name, planned in (("act_type", spec.act.dst_type), ("wts_type", spec.wts.dst_type)):
                if getattr(entry, name) != planned:
                    raise ValueError(f"record_file: layer {key!r} was quantized with {name} "
                                     f"{getattr(entry, name)}, but the config asks for {planned}")

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
            # A recurrent layer's outputs feed float ops in the deploy model: no observer.
            parts.observe_output = not isinstance(module, (nn.LSTM, nn.GRU))
            if d.bn is not None and _foldable(module, ctx.model.get_submodule(d.bn)):
                bn = parts.bn = ctx.model.get_submodule(d.bn)
                set_module(ctx.model, d.bn, nn.Identity().train(bn.training))

    def to_record(self, state: QuantState, layers, record: ScaleOffsetRecord) -> None:
        # Every compressed layer in wrapping order: the record lists entries as it always has.
        for name, layer in layers.items():
            if isinstance(layer, RecurrentLayer):
                found = dict(_recurrent_entries(name, layer))
                for key in record_keys(name, layer.num_layers, layer.bidirectional):
                    entry = found.get(key, state.stored.get(key))
                    if entry is not None:
                        record.record.add(key=key).value.CopyFrom(entry)
                continue
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
            parts.weight_format = layer.wts_quant.format
        obs = layer.out_observer
        if obs is not None and bool(obs.initialized):
            parts.output_range = (float(obs.min_val), float(obs.max_val))
