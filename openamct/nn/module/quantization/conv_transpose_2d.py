"""``ConvTranspose2dQAT``: torch.nn.ConvTranspose2d with single-op QAT (``base.QATLayer``).
groups > 1 is refused: its output channels are not one axis of the weight, so no per-axis
DequantizeLinear expresses its weight quantization."""

from __future__ import annotations

from torch import nn

from openamct.nn.module.quantization.base import CONV_TRANSPOSE_FIELDS, QATLayer

__all__ = ["ConvTranspose2dQAT"]


class ConvTranspose2dQAT(QATLayer, nn.ConvTranspose2d):
    """Upstream's constructor: ``nn.ConvTranspose2d``'s arguments in upstream's positional order
    (``dilation`` and ``groups`` right after ``padding``, as ``Conv2dQAT`` takes them), then
    ``config``; torch's ``output_padding`` (which upstream's constructor lacks) is keyword-only.
    ``from_float(mod, config)`` keeps ``mod``'s output_padding."""

    _ctor_fields = CONV_TRANSPOSE_FIELDS
    _layer_cls = nn.ConvTranspose2d

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 padding_mode="zeros", device=None, dtype=None, config=None, *, output_padding=0) -> None:
        nn.ConvTranspose2d.__init__(self, in_channels, out_channels, kernel_size, stride, padding, output_padding,
                                    groups, bias, dilation, padding_mode, device=device, dtype=dtype)
        self._setup_qat(config)

    def forward(self, x, output_size=None):
        self._check_output_size(x, output_size)
        return super().forward(x)
