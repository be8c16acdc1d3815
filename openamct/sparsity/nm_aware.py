"""Data-aware 2:4 masks (an openamct extension of ``n_out_of_m_pruner``: ``activation_aware_prune``).

In each group of 4 weights along the input axis, keep the 2 with the largest ``|w| * ||x||``,
where ``||x||`` is the L2 norm of the layer's input feature (channel) over the first
``batch_num`` forwards (the Wanda criterion): a small weight on a feature with large inputs
matters more than a large one on a feature that is almost always zero. Scaling the weight by a
positive per-input-feature factor and taking the usual 2:4 magnitude mask gives exactly that.

Until ``batch_num`` forwards have been seen the layer uses the magnitude mask (as
``l1_selective_prune`` computes it); at the ``batch_num``-th forward the data-aware mask
replaces it, and then it stays (no ``update_freq``). The record and restore see an ordinary 2:4
mask: a restored layer installs the record's bits and never recomputes them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from openamct.layer_types import layer_type_of
from openamct.sparsity.nm import NMSparsifier

__all__ = ["DataAwareNMSparsifier"]


class DataAwareNMSparsifier(NMSparsifier):
    """``NMSparsifier`` whose mask is decided from ``|w| * ||x||`` (module docstring). The layer
    calls ``observe(x)`` with its input before each forward's weight path."""

    def __init__(self, weight_shape, axis: int, batch_num: int, *, channel_axis: int = -1, groups: int = 1,
                 dtype=None, device=None) -> None:
        super().__init__(weight_shape, axis, 0, groups=groups, dtype=dtype, device=device)
        self.channel_axis = channel_axis  # the input's feature axis: -1 (matrix layers) or 1 (convolutions)
        if groups != 1:
            raise ValueError("data-aware 2:4 masks need an ungrouped layer (groups=1)")
        self.batch_num = max(1, int(batch_num))
        self.register_buffer("in_sq", torch.zeros(self.weight_shape[axis], dtype=torch.float64, device=device))
        self.register_buffer("aware_seen", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("aware_done", torch.zeros((), dtype=torch.bool, device=device))
        self._seen, self._done = 0, False  # host mirrors (see NMSparsifier._ready)

    @classmethod
    def from_module(cls, module, update_freq: int = 0, batch_num: int = 1) -> DataAwareNMSparsifier:
        base = NMSparsifier.from_module(module, 0)  # the eligibility check and the geometry
        row = layer_type_of(module)
        return cls(tuple(base.weight_shape), base.axis, batch_num, channel_axis=-1 if row.matrix else 1,
                   groups=base.groups,
                   dtype=module.weight.dtype, device=module.weight.device)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", data_aware=True, batch_num={self.batch_num}"

    @torch.no_grad()
    def observe(self, x: Tensor) -> None:
        """Add the squared input of one forward, per input feature (Linear: the last axis;
        convolutions: the channel axis, summed over batch and positions)."""
        if self._done or self._seen >= self.batch_num or not x.is_floating_point():
            return
        n = self.in_sq.numel()
        if x.dim() < 2 or x.shape[self.channel_axis] != n:
            return
        sq = x.detach().double().movedim(self.channel_axis, -1).reshape(-1, n).square().sum(0)
        self.in_sq.add_(sq.to(self.in_sq.device))
        self._seen += 1
        self.aware_seen.fill_(self._seen)

    def current_bits(self, w: Tensor) -> Tensor:
        if not self._done and self._seen >= self.batch_num:
            shape = [1] * w.dim()
            shape[self.axis] = -1
            scale = self.in_sq.sqrt().to(w.dtype).reshape(shape)
            self._recompute(w.detach() * scale)
            self._done = True
            self.aware_done.fill_(True)
        return super().current_bits(w)

    def set_mask_bits(self, bits: Tensor) -> None:
        super().set_mask_bits(bits)  # a recorded mask (restore): final
        self._done = True
        self.aware_done.fill_(True)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        self._done = bool(self.aware_done.item())
        self._seen = int(self.aware_seen.item())
