"""What the plan says for one layer: plain frozen values, no protobuf objects."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ActSpec:
    """ULQ input-activation quantization. ``fixed_min=None`` means: pin clip_min at 0 when the
    layer's input comes from a ReLU (decided from the graph)."""

    clip_max: float | None = None
    clip_min: float | None = None
    fixed_min: bool | None = None
    dst_type: str = "INT8"


@dataclass(frozen=True)
class WtsSpec:
    algo: str = "arq"  # "arq" | "ulq"
    channel_wise: bool = True
    dst_type: str = "INT8"


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
    n: int = 2
    m: int = 4


@dataclass
class LayerPlan:
    name: str
    type: str
    quant: QuantSpec | None = None
    prune: FilterSpec | NMSpec | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def filter(self) -> FilterSpec | None:
        return self.prune if isinstance(self.prune, FilterSpec) else None

    @property
    def nm(self) -> NMSpec | None:
        return self.prune if isinstance(self.prune, NMSpec) else None


@dataclass
class Plan:
    layers: dict[str, LayerPlan]
    batch_num: int = 1

    def quantized(self) -> list[LayerPlan]:
        return [lp for lp in self.layers.values() if lp.quant is not None]

    def filter_pruned(self) -> list[LayerPlan]:
        return [lp for lp in self.layers.values() if lp.filter is not None]

    def nm_pruned(self) -> list[LayerPlan]:
        return [lp for lp in self.layers.values() if lp.nm is not None]

    def is_empty(self) -> bool:
        return not any(lp.quant or lp.prune for lp in self.layers.values())
