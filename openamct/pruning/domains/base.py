"""The contract every pruning domain (CNN channels, dense FFN width, MoE experts) fulfils.

A domain finds the groups of channels that must be cut together (``Unit``), scores each channel
of a group, runs a trial with some channels masked to zero without copying the model, and finally
removes the channels in place. The search in ``openamct.pruning.search`` speaks only this protocol.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Unit:
    """One group of channels that must be cut together."""

    name: str  # stable: the module path of the producer (or expert block)
    size: int  # channels (or experts) in the group
    params_per_channel: int  # parameters removed per channel cut (for size budgets and reports)
    members: tuple[str, ...] = ()  # module paths the cut touches
    extra: dict = field(default_factory=dict)  # domain-private data


class Domain(Protocol):
    """What the search needs of a domain; ``data`` is a list of model inputs (tensors or dicts)."""

    name: str  # "cnn" | "dense" | "moe"

    def units(self, model, example_inputs) -> list[Unit]:
        """The prunable groups of ``model``, found on ``example_inputs``."""
        ...

    def scores(self, model, units, data, criterion: str) -> dict[str, torch.Tensor]:
        """Per unit name, a float tensor of ``size`` scores: higher means keep."""
        ...

    def masked(self, model, keep: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
        """A trial without copying: the channels not kept read as zero; restored on exit."""
        ...

    def apply(self, model, keep: dict[str, torch.Tensor], data, *, reconstruct: bool) -> None:
        """In place: remove the channels not kept, least-squares reconstruct the consumers if
        asked, and rewrite the Hugging Face config dims."""
        ...
