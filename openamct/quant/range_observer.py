"""``RangeObserver``: the running range of a layer's output, for the deploy model's output
quantization where training has no quantizer of its own."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from openamct.formats import INT8_ACT, QuantFormat, check_format
from openamct.quant.functions import graph_mode, ulq_qparams_float
from openamct.quant.host_flags import forget_host_flags, host_flag, set_host_flag

__all__ = ["RangeObserver"]


class RangeObserver(nn.Module):
    """Exponential moving min/max (the first update copies), updated in training mode only: of
    the whole tensor, or per slice along ``axis`` when given ``channels`` (the single-op modules'
    output channels). A per-tensor checkpoint loads into a per-channel observer as its range on
    every channel."""

    def __init__(self, momentum: float = 0.1, fmt: QuantFormat = INT8_ACT, channels: int | None = None,
                 axis: int = 1) -> None:
        super().__init__()
        self.format = check_format(fmt, symmetric=False)
        if not 0.0 < float(momentum) <= 1.0:
            raise ValueError(f"momentum: must be in (0, 1], got {momentum}")
        self.momentum = float(momentum)
        self.axis = int(axis)  # the channel axis (negative counts from the end), when per channel
        shape = () if channels is None else (int(channels),)
        self.register_buffer("min_val", torch.zeros(shape))
        self.register_buffer("max_val", torch.zeros(shape))
        self.register_buffer("initialized", torch.tensor(False))
        set_host_flag(self, "initialized", False)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        for name in ("min_val", "max_val"):
            v = state_dict.get(prefix + name)
            if v is not None and v.dim() == 0 and getattr(self, name).dim() == 1:
                state_dict[prefix + name] = v.expand_as(getattr(self, name)).clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        forget_host_flags(self)

    def forward(self, x: Tensor) -> Tensor:
        if self.training and not graph_mode() and x.numel():
            with torch.no_grad():
                t = x.detach()
                if self.min_val.dim():
                    lo, hi = torch.aminmax(t.movedim(self.axis, 0).reshape(t.shape[self.axis], -1), dim=1)
                else:
                    lo, hi = torch.aminmax(t)
                if host_flag(self, "initialized"):  # three ops a step, no host read
                    self.min_val.lerp_(lo.float(), self.momentum)
                    self.max_val.lerp_(hi.float(), self.momentum)
                else:  # the first update copies
                    self.min_val.copy_(lo)
                    self.max_val.copy_(hi)
                    self.initialized.fill_(True)
                    set_host_flag(self, "initialized", True)
        return x

    def scale_offset(self) -> tuple[float, int]:
        """Asymmetric (scale, offset) in ``format`` over [min(min, 0), max(max, 0)], ULQ convention."""
        s, zp, _, _ = ulq_qparams_float(self.max_val.item(), self.min_val.item(), False, self.format)
        return s, zp

    def extra_repr(self) -> str:
        per = f", channels={self.min_val.numel()}, axis={self.axis}" if self.min_val.dim() else ""
        return (f"momentum={self.momentum}{per}, min={float(self.min_val.min()):.6g}, "
                f"max={float(self.max_val.max()):.6g}, initialized={bool(self.initialized)}")
