"""``Conv3dQAT``: torch.nn.Conv3d with single-op QAT (``base.QATLayer``)."""

from __future__ import annotations

from torch import nn

from openamct.nn.module.quantization.base import CONV_FIELDS, QATLayer

__all__ = ["Conv3dQAT"]


class Conv3dQAT(QATLayer, nn.Conv3d):
    """``nn.Conv3d``'s constructor plus ``config`` (see ``config``); ``from_float(mod, config)``."""

    _ctor_fields = CONV_FIELDS
    _layer_cls = nn.Conv3d

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None, config=None) -> None:
        nn.Conv3d.__init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                           padding_mode, device=device, dtype=dtype)
        self._setup_qat(config)

