"""What the dense and MoE domains share: running the calibration data under hooks, stopping a
forward early, swapping a parameter for a smaller one, and writing a Hugging Face config field."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from openamct.pruning.batches import run

logger = logging.getLogger(__name__)


class StopForward(Exception):
    """Raised by a hook once it has what it needs, so that the rest of the forward is not run."""


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """Eval mode and no autograd for the duration; the model's mode is put back after."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def forward_all(model: nn.Module, data: list, *, stop_early: bool = False) -> None:
    """Run every batch (the hooks installed collect what they need)."""
    with evaluating(model):
        for batch in data:
            try:
                run(model, batch)
            except StopForward:
                if not stop_early:
                    raise


@contextlib.contextmanager
def hooks(handles: list):
    """Remove the hooks on exit, whatever happened inside."""
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()


def set_param(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace ``module.<name>`` by a new parameter of ``value``, keeping requires_grad."""
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.to(old.dtype).contiguous(), requires_grad=old.requires_grad))


def rewrite_config(model: nn.Module, fields: tuple[str, ...], old: int, new: set[int], what: str,
                   warnings: list[str]) -> list[str]:
    """Set the config fields holding ``old`` to the one new value; when the layers disagree (``new``
    has several values) leave them and say so. Returns the fields written."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    names = [f for f in fields if getattr(config, f, None) == old]
    if not names:
        return []
    if len(new) != 1:
        msg = (f"{what}: the pruned layers have different widths {sorted(new)}, which one config field "
               f"cannot describe; {names} left at {old}, so from_pretrained will not rebuild this model")
        logger.warning(msg)
        warnings.append(msg)
        return []
    value = next(iter(new))
    for f in names:
        setattr(config, f, value)
    return names


def keep_index(keep: torch.Tensor) -> torch.Tensor:
    """A boolean keep mask as the sorted indices it keeps."""
    return torch.nonzero(keep.to(torch.bool), as_tuple=False).flatten()
