"""What the plan says for one layer: plain frozen values, no protobuf objects.

``LayerPlan.specs`` maps a technique's name to its slice; the slice types of the built-in
techniques are the frozen dataclasses below (a new technique may bring its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from openamct.formats import QuantFormat, activation_format, weight_format


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


@dataclass(frozen=True)
class FilterSpec:
    ratio: float
    ascend_optimized: bool = True


@dataclass(frozen=True)
class NMSpec:
    update_freq: int = 0
    data_aware: bool = False  # openamct's activation_aware_prune: |w| * ||x|| over batch_num forwards
    batch_num: int = 1
    n: int = 2
    m: int = 4


@dataclass
class LayerPlan:
    """One layer's plan: each technique's slice of the config for it, keyed by technique name
    (what its ``layer_spec`` returned; a technique the config does not select it for has no key),
    and notes on why something was not planned (``openamct inspect`` shows them)."""

    name: str
    type: str
    specs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    # Shorthands for the built-in techniques' slices, for readers outside the technique loop
    # (``openamct inspect``, the channel search, tests). The pipeline, the plan resolution, the
    # record keeper and the export read ``specs`` through the techniques only.
    @property
    def quant(self) -> QuantSpec | None:
        return self.specs.get("quant")

    @property
    def filter(self) -> FilterSpec | None:
        return self.specs.get("filter_prune")

    @property
    def nm(self) -> NMSpec | None:
        return self.specs.get("2:4")

    @property
    def prune(self) -> FilterSpec | NMSpec | None:
        return self.filter or self.nm


@dataclass
class Plan:
    layers: dict[str, LayerPlan]
    batch_num: int = 1
    # openamct's ``quantize_activation_matmul``: attention's activation x activation MatMuls in int8
    activation_matmul: bool = False

    def selected(self, technique: str) -> list[LayerPlan]:
        """The layers whose plan has a slice for ``technique`` (by its name), in layer order."""
        return [lp for lp in self.layers.values() if technique in lp.specs]

    def is_empty(self) -> bool:
        return not any(lp.specs for lp in self.layers.values())

    # Shorthands for the built-in techniques (see LayerPlan).
    def quantized(self) -> list[LayerPlan]:
        return self.selected("quant")

    def filter_pruned(self) -> list[LayerPlan]:
        return self.selected("filter_prune")

    def nm_pruned(self) -> list[LayerPlan]:
        return self.selected("2:4")
