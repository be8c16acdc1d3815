"""``ConvTranspose1dQAT``: torch.nn.ConvTranspose1d with single-op QAT (``base.QATLayer``).
groups > 1 is refused: its output channels are not one axis of the weight, so no per-axis
DequantizeLinear expresses its weight quantization."""

from __future__ import annotations

from torch import nn

from openamct.nn.module.quantization.base import CONV_TRANSPOSE_FIELDS, QATLayer

__all__ = ["ConvTranspose1dQAT"]


class ConvTranspose1dQAT(QATLayer, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d``'s constructor plus ``config``; ``from_float(mod, config)``."""

    _ctor_fields = CONV_TRANSPOSE_FIELDS
    _layer_cls = nn.ConvTranspose1d

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", device=None, dtype=None, config=None) -> None:
        nn.ConvTranspose1d.__init__(self, in_channels, out_channels, kernel_size, stride, padding, output_padding,
                                    groups, bias, dilation, padding_mode, device=device, dtype=dtype)
        self._setup_qat(config)


    def forward(self, x, output_size=None):
        if output_size is not None:
            raise ValueError(f"output_size: {type(self).__name__} takes its output size from output_padding; "
                             "set output_padding instead of passing output_size")
        return super().forward(x)
