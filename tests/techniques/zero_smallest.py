"""A toy fourth technique, the worked example of docs/dev/ARCHITECTURE.md: zero the smallest
1 % (by magnitude) of the weights of every layer the config compresses, decided once at
create from the weights as they are then (after channel pruning), kept through training,
recorded, replayed at restore, folded into the exported weights.

It is one module; a registry that includes it is one line:
``techniques = (*openamct.techniques.TECHNIQUES, ZeroSmallest())``.
"""

from __future__ import annotations

import torch
from torch import nn

from openamct.record import attrs
from openamct.record.mask_codec import pack_mask, unpack_mask
from openamct.techniques.base import Technique, selective_algorithm

ALGORITHM = "zero_smallest"
SHARE = 0.01


class FixedMask(nn.Module):
    """A weight mask that never changes (the ``masks`` part of a compressed layer)."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask.to(torch.float32).clone())

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.mask.to(w.dtype)


def smallest_mask(w: torch.Tensor, share: float = SHARE) -> torch.Tensor:
    """1 where a weight is kept; the max(1, share * numel) smallest |w| are 0 (ties: lower index)."""
    k = max(1, int(share * w.numel()))
    order = torch.argsort(w.detach().abs().reshape(-1), stable=True)
    keep = torch.ones(w.numel(), dtype=torch.bool)
    keep[order[:k]] = False
    return keep.reshape(w.shape)


class ZeroSmallest(Technique):
    name = ALGORITHM
    after = ("filter_prune",)  # decided from the weights channel pruning left
    # No config slice of its own (family None): it follows every layer another technique plans.

    def planned(self, plan):
        return [lp for lp in plan.layers.values() if lp.specs]

    def owns(self, entry) -> bool:
        return selective_algorithm(entry) == ALGORITHM

    def plan(self, ctx):
        return {lp.name: smallest_mask(ctx.model.get_submodule(lp.name).weight) for lp in self.planned(ctx.plan)}

    def from_record(self, ctx):
        masks = {}
        for entry in ctx.record.prune_record:
            if self.owns(entry):
                node = entry.selective_prune
                masks[node.name] = unpack_mask(attrs.get_ints(node, "mask_shape"), attrs.get_ints(node, "selective_mask"))
        return masks

    def check_restore(self, ctx, masks) -> None:
        planned = {lp.name for lp in self.planned(ctx.plan)}
        for name, mask in masks.items():
            if name not in planned or tuple(mask.shape) != tuple(ctx.model.get_submodule(name).weight.shape):
                raise ValueError(f"record_file: the {ALGORITHM} mask of layer {name!r} does not fit this model")

    def apply(self, ctx, masks) -> None:
        for name, mask in masks.items():
            ctx.parts_of(name).masks[ALGORITHM] = FixedMask(mask)

    def to_record(self, masks, layers, record) -> None:
        for name, mask in masks.items():
            node = record.prune_record.add().selective_prune
            node.name = name
            attrs.add_str(node, "algorithm", ALGORITHM)
            shape, words = pack_mask(mask)
            attrs.add_ints(node, "mask_shape", shape)
            attrs.add_ints(node, "selective_mask", words)
