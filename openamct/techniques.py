"""The three techniques, each with the same verbs, applied in a loop by the pipeline.

Order matters and is fixed: channels are removed first (the model really shrinks), 2:4 then
works on what remains, and the quantizers go in last. Each technique either *decides* (create:
from the weights and the graph) or *replays* (restore: from the record, never re-deciding),
then contributes its parts to the one wrapper (`CompressedLayer`) each layer becomes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from openamct.config.specs import Plan
from openamct.graph.graph import Graph
from openamct.graph.layers import LayerInfo
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord

logger = logging.getLogger(__name__)


@dataclass
class Context:
    model: nn.Module  # the working copy, edited in place
    graph: Graph
    layers: dict[str, LayerInfo]
    plan: Plan
    record: ScaleOffsetRecord  # create: filled here; restore: read from here
    restoring: bool
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)  # layer -> CompressedLayer.wrap kwargs
    report: dict[str, Any] = field(default_factory=dict)  # what inspect/report show


def get_module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


class FilterPruning:
    name = "filter_prune"

    def wanted(self, ctx: Context) -> bool:
        has_records = any(not pr.HasField("selective_prune") for pr in ctx.record.prune_record)
        return has_records if ctx.restoring else bool(ctx.plan.filter_pruned())

    def decide(self, ctx: Context) -> list:
        from openamct.graph.dependency import analyse
        from openamct.prune.filter import score_and_select

        groups, blocked = analyse(ctx.graph, ctx.layers, ctx.plan)
        score_and_select(ctx.model, groups)
        ctx.report["filter_groups"] = groups
        ctx.report["filter_blocked"] = blocked
        return [g for g in groups if g.removed]

    def replay(self, ctx: Context) -> list:
        from openamct.prune.filter_record import groups_from_records

        return groups_from_records(ctx.record, ctx.model)

    def apply(self, ctx: Context, groups: list) -> None:
        from openamct.prune.filter import apply_removal

        apply_removal(ctx.model, groups)

    def record(self, ctx: Context, groups: list) -> None:
        from openamct.prune.filter_record import groups_to_records

        groups_to_records(groups, ctx.record)


class Sparsity24:
    name = "2:4"

    def wanted(self, ctx: Context) -> bool:
        return bool(ctx.plan.nm_pruned())

    def decide(self, ctx: Context) -> dict:
        # Masks are computed from the weights at the first training batch, not here.
        return {lp.name: None for lp in ctx.plan.nm_pruned()}

    def replay(self, ctx: Context) -> dict:
        from openamct.session import masks_in_record

        masks = masks_in_record(ctx.record)
        planned = {lp.name for lp in ctx.plan.nm_pruned()}
        for name in masks:
            if name not in planned:
                raise ValueError(f"record_file holds a 2:4 mask for layer {name!r}, which the config does not "
                                 "sparsify in this model (record from another model or config?)")
        return {name: masks.get(name) for name in planned}

    def apply(self, ctx: Context, masks: dict) -> None:
        from openamct.prune.nm import NMSparsifier

        for name, mask in masks.items():
            module = get_module(ctx.model, name)
            sp = NMSparsifier.from_module(module, ctx.plan.layers[name].nm.update_freq)
            if mask is not None:
                if tuple(mask.shape) != tuple(module.weight.shape):
                    raise ValueError(f"record_file: the 2:4 mask of layer {name!r} has shape {list(mask.shape)} but "
                                     f"the layer's weight is {list(module.weight.shape)} (record from another model?)")
                sp.set_mask(mask)
            ctx.parts.setdefault(name, {})["sparsity"] = sp

    def record(self, ctx: Context, masks: dict) -> None:
        """Masks reach the record through the RecordKeeper once computed."""


class Quantization:
    name = "quant"

    def wanted(self, ctx: Context) -> bool:
        return bool(ctx.plan.quantized())

    def decide(self, ctx: Context) -> dict:
        """Structure only: which layers, with what settings, sharing which input quantizer.
        The numbers come from the first batches (create) or the checkpoint (restore)."""
        decisions = {}
        for lp in ctx.plan.quantized():
            act = lp.quant.act
            fixed = act.fixed_min if act.fixed_min is not None else ctx.graph.fed_by_relu(lp.name)
            src = ctx.graph.input_tensor(lp.name)
            bn = ctx.graph.single_bn_after(lp.name)
            call = ctx.graph.call_of(lp.name)
            if bn is not None and lp.type == "Linear" and len(call.outputs[0].shape) != 2:
                bn = None  # BatchNorm1d after a 3-D Linear output normalises another axis
            decisions[lp.name] = {
                "spec": lp.quant, "fixed_min": bool(fixed),
                # Layers reading the same tensor with the same settings share one quantizer:
                # one Q/DQ per tensor lets ONNX Runtime keep that tensor in int8 (see export).
                "share_key": (src.key if src is not None else lp.name, act, bool(fixed)),
                "bn": bn,
            }
        return decisions

    replay = decide

    def apply(self, ctx: Context, decisions: dict) -> None:
        from openamct.quant.factory import make_act_quantizer, make_weight_quantizer

        shared: dict[tuple, nn.Module] = {}
        for name, d in decisions.items():
            module = get_module(ctx.model, name)
            parts = ctx.parts.setdefault(name, {})
            aq = shared.get(d["share_key"])
            if aq is None:
                aq = shared[d["share_key"]] = make_act_quantizer(d["spec"].act, d["fixed_min"], ctx.plan.batch_num)
            parts["act_quant"] = aq
            parts["wts_quant"] = make_weight_quantizer(d["spec"].wts, module)
            parts["observe_output"] = True
            if d["bn"] is not None and _foldable(module, get_module(ctx.model, d["bn"])):
                bn = parts["bn"] = get_module(ctx.model, d["bn"])
                set_module(ctx.model, d["bn"], nn.Identity().train(bn.training))

    def record(self, ctx: Context, decisions: dict) -> None:
        """Scales reach the record through the RecordKeeper (first eval forward, or save)."""


def _foldable(layer: nn.Module, bn: nn.Module) -> bool:
    out = getattr(layer, "out_channels", getattr(layer, "out_features", None))
    return isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.num_features == out and bn.track_running_stats


TECHNIQUES = (FilterPruning(), Sparsity24(), Quantization())


def wrap_layers(ctx: Context) -> dict[str, nn.Module]:
    """Replace every layer that got parts by one CompressedLayer holding them."""
    from openamct.quant.layer import CompressedLayer

    wrapped = {}
    for name, parts in ctx.parts.items():
        layer = CompressedLayer.wrap(get_module(ctx.model, name), **parts)
        set_module(ctx.model, name, layer)
        wrapped[name] = layer
    return wrapped
