"""Replacing a submodule by its dotted name (what every technique and the export do)."""

from __future__ import annotations

from torch import nn


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
