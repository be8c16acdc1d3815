"""What the search must fit in: a cost function of the kept channel counts and its target.

``budget="macs"`` builds one in ``auto_search``; ``budget="latency"`` builds one in ``latency``
with its latency table and the folder its ONNX files are written to (the caller owns that
folder and removes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Budget"]


@dataclass
class Budget:
    """``cost(kept)`` in ``unit`` must not exceed ``target``; ``base`` is the unpruned cost.
    ``table`` (a ``LatencyTable``) and ``folder`` are set for the latency budget only."""

    cost: Callable[[list[int]], float]
    base: float
    target: float
    unit: str
    table: Any = None
    folder: str | None = None
