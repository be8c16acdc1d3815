"""What the plan says for one layer: plain frozen values, no protobuf objects.

``LayerPlan.specs`` maps a technique's name to its slice; each technique defines its slice's
type beside itself (``techniques.quantization.QuantSpec``, ``techniques.filter_prune.FilterSpec``,
``techniques.sparsity24.NMSpec``, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    def quant(self):  # -> techniques.quantization.QuantSpec | None
        return self.specs.get("quant")

    @property
    def filter(self):  # -> techniques.filter_prune.FilterSpec | None
        return self.specs.get("filter_prune")

    @property
    def nm(self):  # -> techniques.sparsity24.NMSpec | None
        return self.specs.get("2:4")

    @property
    def prune(self):  # the filter or n:m slice
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
