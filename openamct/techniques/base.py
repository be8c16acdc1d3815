"""The verbs every compression technique has, and what they share while a model is built.

A technique goes through one model's life like this (``openamct.pipeline`` runs the loop, in
registry order, for create and restore; the record keeper and the export ask afterwards):

- create:  ``plan`` (decide from the per-layer plan, the graph and the weights) -> ``apply``;
- restore: ``from_record`` (read its own entries of the record, never re-deciding) ->
  ``check_restore`` -> ``apply``; after the checkpoint is loaded, ``after_checkpoint``;
- every record write: ``to_record`` (its own entries), ``record_due`` (must the record be
  rewritten after this forward?) and ``mark_recorded``;
- save: ``export_parts`` (what the fake-quant and deploy writers need from a layer);
- training: ``losses`` (terms the user adds to the training loss: a teacher's, a penalty's).

What a technique declares (class attributes) instead of what the core would otherwise know:

- ``name``: the key of its slice in ``LayerPlan.specs`` and in ``after`` declarations;
- ``after``: names of techniques that must run before it (``openamct.techniques.order``
  sorts a registry from these, refusing a cycle or an unknown name);
- its config slice: ``family`` (which shared priority rules of ``config.rules`` apply; None
  for a technique the config does not configure), ``configured_by`` (does a config block ask
  for it), ``validate_block`` (its own fields' values) and ``layer_spec`` (its slice for one
  layer, or None, with a note saying why not);
- its eligibility: ``layer_types`` (torch class names it may touch) and ``eligible`` (a
  module-level check, e.g. 2:4 needs 4 input channels per group).

``plan``/``from_record`` return the technique's *state* for this model (any object); the
other verbs receive it back. ``apply`` either edits ``ctx.model`` (channels removed) or hands
parts to the layers through ``ctx.parts_of(name)``, which the pipeline then wraps into one
``CompressedLayer`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from openamct.compressed.parts import LayerParts
from openamct.config.rules import PRUNE, PRUNE_SKIPPED, Family, winning_block
from openamct.config.specs import LayerPlan, Plan
from openamct.formats import QuantFormat
from openamct.graph.graph import Graph
from openamct.graph.layers import LayerInfo
from openamct.layer_types import ALL_TYPES
from openamct.record import attrs
from openamct.record.scale_offset_record_pb2 import PruneRecord, ScaleOffsetRecord


@dataclass
class Context:
    """What create/restore hand to every technique (one per call)."""

    model: nn.Module  # the working copy, edited in place
    graph: Graph
    layers: dict[str, LayerInfo]
    plan: Plan
    record: ScaleOffsetRecord  # restore: the record read; create: empty
    restoring: bool
    record_file: str | None = None  # restore: the record's path (its mask file lies beside it)
    input_data: Any = None  # the caller's sample batch (a technique may run the model on it)
    parts: dict[str, LayerParts] = field(default_factory=dict)

    def parts_of(self, name: str) -> LayerParts:
        return self.parts.setdefault(name, LayerParts())


@dataclass
class ExportParts:
    """One layer's numbers for the export writers; techniques fill the fields they own."""

    input_quant: tuple[float, int] | None = None  # (scale, int8 offset) of the input quantizer
    weight_scales: Tensor | None = None  # weight scales, Cout order (or 1 per tensor)
    weight_per_channel: bool = False
    weight_format: QuantFormat | None = None  # the weight quantizer's format (INT8 when None)
    output_range: tuple[float, float] | None = None  # trained (min, max) of the output
    output_quant: tuple[float, int] | None = None  # (scale, int8 offset) of an output quantizer

    @property
    def quantized(self) -> bool:
        return self.input_quant is not None or self.weight_scales is not None


def selective_algorithm(entry: PruneRecord) -> str | None:
    """The ``algorithm`` attribute of a selective_prune entry (None in upstream's 2:4 records).
    Techniques that store per-weight masks tag their entries with it."""
    return attrs.get_str(entry.selective_prune, "algorithm") if entry.HasField("selective_prune") else None


class Technique:
    """Base class: the defaults are "nothing to do"; a technique overrides what it owns."""

    name = ""
    after: tuple[str, ...] = ()  # techniques that must have been applied before this one
    family: Family | None = None  # its config slice's priority rules; None: no config fields
    layer_types: tuple[str, ...] = ALL_TYPES  # the layer types (torch class names) it may touch
    # True: ``to_record`` takes ``sidecar=`` (a record.sidecar.SidecarOut) and may put bulky
    # data beside the record instead of in it.
    writes_sidecar = False

    # -- config slice (read by config.validate / config.plan, which know no field of it) ----------
    def configured_by(self, block) -> bool:
        """Whether a config block (global or override) asks for this technique."""
        return False

    def validate_block(self, block, where: str, text: str, src: str) -> None:
        """Raise ConfigError (naming ``src``, the line via ``config.errors.locate``, and ``where``)
        for a bad value of this technique's fields in ``block``."""

    def layer_spec(self, cfg, info: LayerInfo, api: str, notes: list[str]):
        """This technique's slice of the config for one layer (stored as ``LayerPlan.specs[name]``),
        or None; append to ``notes`` why a layer the config asks for is left out."""
        return None

    def eligible(self, info: LayerInfo) -> str | None:
        """None when this technique may touch the layer, else why not (for the plan's notes)."""
        return None if info.type in self.layer_types else f"{info.type} is not supported by {self.name}"


    def prune_block(self, cfg, info: LayerInfo, notes: list[str]):
        """The config block that asks this (pruning) technique to prune ``info``'s layer, by the
        pruning priority rules, or None with the reason in ``notes`` (skipped, not eligible)."""
        block, skipped = winning_block(cfg, PRUNE, info.name, info.type)
        if block is None or not self.configured_by(block):
            return None
        if skipped:
            notes.append(PRUNE_SKIPPED)
            return None
        why_not = self.eligible(info)
        if why_not is not None:
            notes.append(why_not)
            return None
        return block
    def planned(self, plan: Plan) -> list[LayerPlan]:
        """The layers the config selects for this technique."""
        return plan.selected(self.name)

    def owns(self, entry: PruneRecord) -> bool:
        """Whether a prune_record entry of a record file is this technique's."""
        return False

    def in_record(self, record: ScaleOffsetRecord) -> bool:
        return any(self.owns(pr) for pr in record.prune_record)

    def wanted(self, ctx: Context) -> bool:
        """Planned by the config, or (restore) present in the record: then ``check_restore``
        decides whether the two fit together."""
        return bool(self.planned(ctx.plan)) or (ctx.restoring and self.in_record(ctx.record))

    def plan(self, ctx: Context) -> Any:
        raise NotImplementedError

    def from_record(self, ctx: Context) -> Any:
        raise NotImplementedError

    def check_restore(self, ctx: Context, state: Any) -> None:
        """Refuse a record that does not fit the model and config (ValueError naming the layer)."""

    def apply(self, ctx: Context, state: Any) -> None:
        raise NotImplementedError

    def to_record(self, state: Any, layers: dict[str, nn.Module], record: ScaleOffsetRecord) -> None:
        """Write this technique's entries for the model as it is now (``layers``: name ->
        CompressedLayer)."""

    def record_due(self, state: Any, layers: dict[str, nn.Module]) -> bool:
        """True when the record no longer says what the model holds (checked after forwards)."""
        return False

    def mark_recorded(self, state: Any, layers: dict[str, nn.Module]) -> None:
        """The record now says what the model holds."""

    def after_checkpoint(self, state: Any, layers: dict[str, nn.Module]) -> None:
        """Restore: reconcile with the checkpoint's values, just loaded over the record's."""

    def decisions(self, record: ScaleOffsetRecord) -> list[tuple[str, bytes]]:
        """(layer, bytes) of this technique's entries in ``record`` that fix choices the trained
        weights depend on but a checkpoint's keys and shapes cannot show (which channels were
        removed). The model carries their digests; restore and save compare them with a record."""
        return []

    def losses(self, state: Any) -> dict[str, Tensor]:
        """Terms of the last training forward the user adds to the loss (none by default)."""
        return {}

    def export_parts(self, layer: nn.Module, parts: ExportParts) -> None:
        """Fill the fields of ``parts`` this technique owns for ``layer`` (a CompressedLayer
        of the eval-mode working copy being exported)."""
