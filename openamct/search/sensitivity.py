"""How much each channel of a coupled group matters: the sensitivity the search ranks by.

``Sensitivity`` is the base class users subclass (upstream's ``SensitivityBase``, also
importable under that name from upstream's module path,
``openamct.common.auto_channel_prune.sensitivity_base``): one method,
``channel_scores``, returning one score per channel of each group (higher = more important;
scores of different groups must be on one scale, since the search compares them).

``TaylorLossSensitivity`` (upstream's default) is the first-order Taylor estimate of the loss
change when a channel goes: ``|g · w|`` over the weights its removal deletes, accumulated over
``test_iteration`` batches. Filter pruning deletes a channel's output *and* the consumers'
input-channel weights that read it; this estimate is taken on the consumers' side, where it is
exact to first order for the whole removal (the producer's bias, the BatchNorm shift and the
ReLU go with it too, which ``g · w`` on the producer's weights would miss). For a consumer
``y = W x``, ``g_W[:, c] · W[:, c] = sum(g_x[c] * x[c])``, so it is computed from each
consumer's input and its gradient, **per sample** (``sum_samples |sum_consumers g · w|``: a
batch-level sum cancels out near a trained optimum, where the mean gradient is ~0).

The model runs in eval mode (BatchNorm uses its running statistics, as after pruning). The loss
is upstream's L1 loss where the labels are float and shaped like the output (upstream's call
example: ``labels = torch.randn(output.size())``), and cross-entropy for ``[batch, classes]``
logits with class-index labels; ``set_loss_func(loss_func)`` (upstream's method) sets another,
or subclass ``TaylorLossSensitivity`` and override ``loss``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from openamct.graph.capture import split_input_data
from openamct.search.named import resolve
from openamct.sparsity.group import PruneGroup

logger = logging.getLogger(__name__)

__all__ = ["Sensitivity", "TaylorLossSensitivity", "SENSITIVITIES", "resolve_sensitivity"]


class Sensitivity:
    """Base class: subclass it and implement ``channel_scores``."""

    def channel_scores(self, model: nn.Module, batches: Sequence[tuple[Any, torch.Tensor]],
                       groups: Sequence[PruneGroup]) -> list[torch.Tensor]:
        """One 1-D tensor of ``group.channels`` scores per group, in order. ``model`` is the
        search's own copy (change it freely); ``batches`` are the first ``test_iteration``
        ``[data, label]`` pairs of ``input_data``; ``group.producers`` / ``group.consumers``
        name the layers (``Member.positions`` maps group channels to a member's axis)."""
        raise NotImplementedError(f"{type(self).__name__} must implement channel_scores")


class TaylorLossSensitivity(Sensitivity):
    """``sum over samples |g · w|`` per channel, on the consumers' side (module docstring)."""

    def __init__(self, loss_func: Any = None) -> None:
        self.loss_func = None
        if loss_func is not None:
            self.set_loss_func(loss_func)

    def set_loss_func(self, loss_func: Any) -> None:
        """Upstream's method: ``loss_func(output, label)`` (a torch loss module) for every batch."""
        if not callable(loss_func):
            raise TypeError(f"loss_func must be callable (a torch loss module), got {type(loss_func).__name__}")
        self.loss_func = loss_func

    def loss(self, output: Any, label: torch.Tensor) -> torch.Tensor:
        """The loss the gradients come from: ``loss_func`` when set; upstream's L1 loss for
        float labels shaped like the output; cross-entropy for ``[batch, classes]`` logits."""
        if self.loss_func is not None:
            return self.loss_func(output, label)
        if isinstance(output, torch.Tensor) and label.is_floating_point() and label.shape == output.shape:
            return F.l1_loss(output, label.to(output.dtype))
        if not isinstance(output, torch.Tensor) or output.dim() != 2:
            shape = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(f"TaylorLossSensitivity uses cross-entropy for class-index labels, which needs "
                             f"[batch, classes] logits; the model returned {shape}: give float labels shaped like "
                             "the output (L1 loss, upstream's), call set_loss_func, or subclass "
                             "TaylorLossSensitivity and override loss(output, label)")
        return F.cross_entropy(output, label)

    def channel_scores(self, model, batches, groups):
        modules = dict(model.named_modules())
        readers: dict[str, list[tuple[int, Any]]] = {}
        for gi, g in enumerate(groups):
            for m in g.consumers:
                if not m.is_function:
                    readers.setdefault(m.name, []).append((gi, m))
        seen: dict[str, torch.Tensor] = {}

        def leaf(name):  # each consumer reads its own alias, so the alias's gradient is its own
            def hook(module, args):
                x = args[0].view_as(args[0]) if args[0].requires_grad else args[0].detach().requires_grad_()
                seen[name] = x
                return (x, *args[1:])
            return hook

        scores = [torch.zeros(g.channels, dtype=torch.float64) for g in groups]
        handles = [modules[n].register_forward_pre_hook(leaf(n)) for n in readers]
        was = {p: p.requires_grad for p in model.parameters()}
        modes = {m: m.training for m in model.modules()}
        try:
            for p in model.parameters():  # the graph must reach back through every layer
                p.requires_grad_(p.is_floating_point())
            model.eval()
            for data, label in batches:
                seen.clear()
                args, kwargs = split_input_data(data)
                with torch.enable_grad():
                    loss = self.loss(model(*args, **kwargs), label)
                if not torch.isfinite(loss):
                    raise ValueError(f"the loss is {loss.item()} on a batch of input_data: check the data and labels")
                names = [n for n in readers if n in seen]
                grads = torch.autograd.grad(loss, [seen[n] for n in names], allow_unused=True)
                per_sample = [None] * len(groups)
                for n, g_x in zip(names, grads):
                    if g_x is None:
                        continue
                    x = seen[n]
                    axis = x.dim() - 1 if isinstance(modules[n], nn.Linear) else 1
                    prod = (g_x * x).detach().to(torch.float64).movedim(axis, -1)
                    pos = prod.reshape(prod.shape[0], -1, prod.shape[-1]).sum(1)  # [samples, input channels]
                    for gi, m in readers[n]:
                        part = pos[:, m.begin:m.end].reshape(pos.shape[0], groups[gi].channels, m.repeat).sum(2)
                        per_sample[gi] = part if per_sample[gi] is None else per_sample[gi] + part
                for gi, t in enumerate(per_sample):
                    if t is not None:
                        scores[gi] += t.abs().sum(0)
        finally:
            for h in handles:
                h.remove()
            for m, flag in modes.items():
                m.training = flag
            for p, flag in was.items():
                p.requires_grad_(flag)
        return scores


SENSITIVITIES = {"TaylorLossSensitivity": TaylorLossSensitivity}


def resolve_sensitivity(sensitivity: Any) -> Sensitivity:
    return resolve("sensitivity", sensitivity, Sensitivity, SENSITIVITIES, "channel_scores",
                   ("get_sensitivity", "setup_initialization"))
