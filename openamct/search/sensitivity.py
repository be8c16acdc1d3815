"""How much each output channel matters: the sensitivity the search ranks channels by.

``Sensitivity`` is the base class users subclass (upstream's contract): one method,
``channel_scores``, returning a score per output channel of each layer asked for (higher =
more important; scores of different layers must be on one scale, since the search compares
them across layers).

``TaylorLossSensitivity`` (upstream's default): the first-order Taylor estimate of the loss
change when a channel's weights go to zero, ``|g · w|`` summed over the channel's weights (and
bias), accumulated over ``test_iteration`` batches: ``sum_b |sum_i g_i w_i|``. The model runs in
**eval mode**: with batch statistics a following BatchNorm makes the loss invariant to the
scale of a channel's weights, so ``g · w`` would be exactly 0 in training mode; in eval mode it
is the loss change of scaling that channel's output. The loss is cross-entropy for 2-D outputs
(``[batch, classes]`` logits with class-index labels); for anything else override ``loss``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from openamct.graph.capture import split_input_data

logger = logging.getLogger(__name__)

__all__ = ["Sensitivity", "TaylorLossSensitivity", "SENSITIVITIES", "resolve_sensitivity"]


class Sensitivity:
    """Base class: subclass it and implement ``channel_scores``."""

    def channel_scores(self, model: nn.Module, batches: Sequence[tuple[Any, torch.Tensor]],
                       layers: Sequence[str]) -> dict[str, torch.Tensor]:
        """``{layer name: 1-D tensor, one score per output channel}`` for every name in
        ``layers``. ``model`` is the search's own copy (change it freely); ``batches`` are the
        first ``test_iteration`` ``[data, label]`` pairs of ``input_data``."""
        raise NotImplementedError(f"{type(self).__name__} must implement channel_scores")


class TaylorLossSensitivity(Sensitivity):
    """``sum over batches |g · w|`` per output channel (see the module docstring)."""

    def loss(self, output: Any, label: torch.Tensor) -> torch.Tensor:
        """The loss the gradients come from; cross-entropy for ``[batch, classes]`` outputs."""
        if not isinstance(output, torch.Tensor) or output.dim() != 2:
            shape = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(f"TaylorLossSensitivity uses cross-entropy, which needs [batch, classes] logits; "
                             f"the model returned {shape}: subclass TaylorLossSensitivity and override "
                             "loss(output, label), then pass an instance as sensitivity=")
        return F.cross_entropy(output, label)

    def channel_scores(self, model, batches, layers):
        modules = dict(model.named_modules())
        params = {name: [p for p in (modules[name].weight, getattr(modules[name], "bias", None))
                         if isinstance(p, torch.Tensor)] for name in layers}
        flat = [p for ps in params.values() for p in ps]
        was = {p: p.requires_grad for p in model.parameters()}
        wanted = {id(p) for p in flat}
        for p in model.parameters():
            p.requires_grad_(id(p) in wanted)
        scores = {name: torch.zeros(modules[name].weight.shape[0], dtype=torch.float64) for name in layers}
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            for data, label in batches:
                args, kwargs = split_input_data(data)
                loss = self.loss(model(*args, **kwargs), label)
                if not torch.isfinite(loss):
                    raise ValueError(f"the loss is {loss.item()} on a batch of input_data: check the data and labels")
                grads = iter(torch.autograd.grad(loss, flat, allow_unused=True))
                for name, ps in params.items():
                    t = torch.zeros(scores[name].shape, dtype=torch.float64)
                    for p in ps:
                        g = next(grads)
                        if g is not None:
                            t += (g.detach() * p.detach()).to(torch.float64).reshape(p.shape[0], -1).sum(1)
                    scores[name] += t.abs()
        finally:
            for m, flag in modes.items():
                m.training = flag
            for p, flag in was.items():
                p.requires_grad_(flag)
        return scores


SENSITIVITIES = {"TaylorLossSensitivity": TaylorLossSensitivity}


def resolve_sensitivity(sensitivity: Any) -> Sensitivity:
    if isinstance(sensitivity, Sensitivity):
        return sensitivity
    if isinstance(sensitivity, str):
        if sensitivity not in SENSITIVITIES:
            raise ValueError(f"sensitivity {sensitivity!r} is not known: use one of {', '.join(SENSITIVITIES)} "
                             "or an instance of a Sensitivity subclass")
        return SENSITIVITIES[sensitivity]()
    raise TypeError(f"sensitivity must be a name (str) or a Sensitivity instance, got {type(sensitivity).__name__}")
