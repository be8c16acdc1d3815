"""``GRUQAT``: torch.nn.GRU with single-op QAT (``rnn_qat_base.RecurrentQAT``)."""

from __future__ import annotations

from torch import nn

from openamct.nn.module.quantization.rnn_qat_base import RecurrentQAT

__all__ = ["GRUQAT"]


class GRUQAT(RecurrentQAT, nn.GRU):
    """``nn.GRU``'s constructor plus ``config``; ``from_float(mod, config)``. Input and hidden
    state quantized per tensor, weights per gate row."""

    _layer_cls = nn.GRU

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, device=None, dtype=None, config=None) -> None:
        nn.GRU.__init__(self, input_size, hidden_size, num_layers, bias=bias, batch_first=batch_first,
                        dropout=dropout, bidirectional=bidirectional, device=device, dtype=dtype)
        self._setup_qat(config)
