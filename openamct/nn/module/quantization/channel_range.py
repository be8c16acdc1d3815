"""``ChannelRangeObserver``: the output range a single-op QAT module observes, per output channel.

The deploy model of single-op modules quantizes a conv's output where a float op (a residual
Add) reads it, so that ONNX Runtime runs QLinearConv; that tensor is the output of the BatchNorm
the deploy model folds into the conv, so its range is the BatchNorm's per-channel affine image
of the conv's. A per-tensor range of the conv output bounds it only loosely (every channel
taken over the widest channel's range: on torchvision's ResNet-18, 1.3 to 2.5 times the range
the folded output has), and a coarser grid. Per channel, the image is exact.

Exponential moving min/max per channel (the first update copies), updated in training mode
only, as ``quant.quantizers.RangeObserver`` per tensor. A checkpoint of the per-tensor observer
loads with its range given to every channel.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from openamct.quant.functions import graph_mode

__all__ = ["ChannelRangeObserver"]


class ChannelRangeObserver(nn.Module):
    def __init__(self, channels: int, axis: int, momentum: float = 0.1) -> None:
        super().__init__()
        if not 0.0 < float(momentum) <= 1.0:
            raise ValueError(f"momentum: must be in (0, 1], got {momentum}")
        self.axis = int(axis)  # the output channel axis; negative counts from the end
        self.momentum = float(momentum)
        self.register_buffer("min_val", torch.zeros(channels))
        self.register_buffer("max_val", torch.zeros(channels))
        self.register_buffer("initialized", torch.tensor(False))

    def forward(self, x: Tensor) -> Tensor:
        if self.training and not graph_mode() and x.numel():
            with torch.no_grad():
                c = x.detach().movedim(self.axis, 0).reshape(x.shape[self.axis], -1)
                lo, hi = torch.aminmax(c, dim=1)
                lo, hi = lo.float(), hi.float()
                first = ~self.initialized
                self.min_val.copy_(torch.where(first, lo, torch.lerp(self.min_val, lo, self.momentum)))
                self.max_val.copy_(torch.where(first, hi, torch.lerp(self.max_val, hi, self.momentum)))
                self.initialized.fill_(True)
        return x

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("min_val", "max_val"):
            v = state_dict.get(prefix + name)
            if v is not None and v.dim() == 0:  # the per-tensor observer's: its range on every channel
                state_dict[prefix + name] = v.expand_as(getattr(self, name)).clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"channels={self.min_val.numel()}, axis={self.axis}, momentum={self.momentum}, "
                f"min={float(self.min_val.min()):.6g}, max={float(self.max_val.max()):.6g}, "
                f"initialized={bool(self.initialized)}")
