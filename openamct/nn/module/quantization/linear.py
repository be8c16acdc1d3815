"""``LinearQAT``: torch.nn.Linear with single-op QAT (``base.QATLayer``)."""

from __future__ import annotations

from torch import nn

from openamct.nn.module.quantization.base import QATLayer

__all__ = ["LinearQAT"]


class LinearQAT(QATLayer, nn.Linear):
    """``nn.Linear``'s constructor plus ``config`` (weights per tensor unless ``channel_wise``);
    ``from_float(mod, config)``."""

    _ctor_fields = ("in_features", "out_features")
    _layer_cls = nn.Linear

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, config=None) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias, device=device, dtype=dtype)
        self._setup_qat(config)
