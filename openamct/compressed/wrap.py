"""Which wrapper a planned layer becomes: one table from layer type to wrapper class."""

from __future__ import annotations

from torch import nn

from openamct.compressed.layer import CompressedLayer
from openamct.compressed.parts import LayerParts
from openamct.compressed.recurrent import RecurrentLayer
from openamct.layer_types import layer_type_of

__all__ = ["WRAPPERS", "wrap_layer", "is_wrapped"]

# Layer types without an entry (every conv and matrix layer) become a CompressedLayer.
WRAPPERS: dict[str, type] = {"LSTM": RecurrentLayer, "GRU": RecurrentLayer}


def wrap_layer(module: nn.Module, parts: LayerParts) -> nn.Module:
    """The compressed form of ``module`` with ``parts``."""
    row = layer_type_of(module)
    cls = WRAPPERS.get(row.name, CompressedLayer) if row is not None else CompressedLayer
    return cls.from_parts(module, parts)


def is_wrapped(module: nn.Module) -> bool:
    return isinstance(module, (CompressedLayer, *WRAPPERS.values()))
