"""Create-time proof that the model's forward can follow each group's channel removal.

Dependency analysis sees the ops a forward ran, not the constants it computed shapes from: a
``view(b, 64, ...)`` written with a literal width (torchvision's MaxViT attention) accepts the
unpruned model and fails on the pruned one. So before any channel is removed for good, the
groups are removed on the working copy, the model runs once on ``input_data``, and everything
is put back. A group whose removal the forward cannot follow stays whole, with one WARNING
naming them; the others are pruned.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from openamct.sparsity.filter import apply_removal, removal_edits
from openamct.sparsity.group import PruneGroup

logger = logging.getLogger(__name__)


def _saved(model: nn.Module, groups: list[PruneGroup]) -> list[tuple[nn.Module, dict, dict]]:
    """What removing ``groups`` replaces: the very tensor objects (no copy) and sizes."""
    out = []
    for module, (tensors, ints) in removal_edits(model, groups):
        out.append((module, {a: getattr(module, a) for a in tensors}, {a: getattr(module, a) for a in ints}))
    return out


def _put_back(saved: list[tuple[nn.Module, dict, dict]]) -> None:
    for module, tensors, ints in saved:
        for attr, value in tensors.items():
            if attr in module._parameters:
                module._parameters[attr] = value
            else:
                module._buffers[attr] = value
        for attr, value in ints.items():
            setattr(module, attr, value)


def _forward_fails(model: nn.Module, groups: list[PruneGroup], input_data: Any) -> str | None:
    """Remove ``groups``, run one eval forward, put everything back; the error, if any."""
    from openamct.graph.capture import split_input_data, untouched

    saved = _saved(model, groups)
    try:
        apply_removal(model, groups, quiet=True)
        args, kwargs = split_input_data(input_data)
        with untouched(model), torch.no_grad():
            model.eval()
            model(*args, **kwargs)
    except Exception as exc:  # whatever the model's own ops raise on the pruned shapes
        return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    finally:
        _put_back(saved)
    return None


def consistent_groups(model: nn.Module, groups: list[PruneGroup], input_data: Any) -> list[PruneGroup]:
    """The groups whose channel removal the forward can follow (``model`` is left as it was)."""
    if input_data is None:
        raise ValueError("filter prune: the consistency check needs the caller's input_data")
    if not groups or _forward_fails(model, groups, input_data) is None:
        return groups
    kept, dropped = [], []
    for g in groups:
        why = _forward_fails(model, [g], input_data)
        (dropped if why else kept).append((g, why))
    kept = [g for g, _ in kept]
    if kept and _forward_fails(model, kept, input_data) is not None:
        dropped += [(g, "fails together with the other groups") for g in kept]
        kept = []
    names = "; ".join(f"{', '.join(g.producer_names)} ({why})" for g, why in dropped[:4])
    more = f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
    logger.warning("filter prune: %d group(s) left whole, because the model's forward fails once their channels "
                   "are removed (a shape written as a constant, e.g. a view to a fixed width): %s%s",
                   len(dropped), names, more)
    return kept


class UnseenLayerCheck:
    """Forward pre-hook of a layer create never saw run (a branch ``input_data`` did not take).
    Filter pruning may have narrowed its input without it knowing: then the forward stops here
    with the layer and the cause named, instead of deep inside torch's conv."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return
        if hasattr(module, "in_channels"):
            want, have = module.in_channels, x.shape[1]
        elif hasattr(module, "in_features"):
            want, have = module.in_features, x.shape[-1]
        else:
            return
        if have != want:
            raise ValueError(
                f"layer {self.name!r} never ran when create ran the model on input_data (a branch input_data did "
                f"not take), and filter pruning has since narrowed its input to {have} channels (it expects "
                f"{want}): give create an input_data that takes this branch, or skip the layers feeding it "
                "(regular_prune_skip_layers)")


def guard_unseen_layers(model: nn.Module, names: list[str]) -> None:
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(UnseenLayerCheck(name))
