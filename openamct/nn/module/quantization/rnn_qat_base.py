"""``RecurrentQAT``: what the single-op LSTM/GRU QAT modules (``lstm.LSTMQAT``, ``gru.GRUQAT``) add
to their torch class.

A recurrent QAT module is a ``compressed.recurrent.RecurrentLayer`` (the class
``create_quant_retrain_model`` puts in place of an LSTM/GRU) that is also its torch class: the
same quantizers (input and hidden state per tensor, ULQ; ``weight_ih``/``weight_hh`` per gate
row, ARQ or ULQ), built from the ``config`` dict (``config.parse_qat_config``) with the graph
flow's factories, and the same forward, so one layer trained either way gives the same weights.

Refused like upstream's: ``proj_size`` > 0, and dtypes other than float32. Upstream's modules
take one layer, one direction and no dropout; these take any ``num_layers``, ``bidirectional``
and ``dropout`` (an openamct extension).

Exported with ``torch.onnx.export`` (the TorchScript exporter, ``dynamo=False``), a module writes
its input quantizer's int8 QuantizeLinear/DequantizeLinear pair and one ONNX LSTM/GRU node per
layer reading int8 DequantizeLinear weights (``export.recurrent.RecurrentDeploy``);
``convert_qat_model`` turns the pair into the fake-quant model's float ops and the deploy
model's uint8 pair and keeps the LSTM/GRU as it is. The hidden state's quantizer has no place in
an ONNX LSTM: both converted files leave it float (the graph flow's fake-quant model keeps it).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from openamct.compressed.recurrent import RecurrentLayer, unsupported
from openamct.export.recurrent import RecurrentDeploy
from openamct.nn.module.quantization.base import exported_input_quant
from openamct.nn.module.quantization.config import QatConfig, parse_qat_config
from openamct.quant.functions import graph_mode
from openamct.techniques.quantization import make_act_quantizer, make_weight_quantizer

__all__ = ["RecurrentQAT"]


@contextlib.contextmanager
def untraced():
    """A region a legacy ``torch.jit`` trace (``torch.onnx.export(dynamo=False)``) does not
    record: what is computed there enters the trace as constants. torch has no public form of
    this; its private tracing-state functions are checked to exist here, and
    ``tests/unit/test_torch_private_apis.py`` fails loudly when torch changes what they do."""
    get, put = (getattr(torch._C, n, None) for n in ("_get_tracing_state", "_set_tracing_state"))
    if get is None or put is None:
        raise ValueError("this torch cannot pause a trace (torch._C._get_tracing_state is gone): export the "
                         "single-op LSTM/GRU QAT modules with the torch version openamct is tested with")
    state = get()
    put(None)
    try:
        yield
    finally:
        put(state)


class _ExportInput(nn.Module):
    """An input quantizer as exported: its Q/DQ pair for INT8; for INT16 data (A16W8), which no
    torch exporter writes as Q/DQ, the same arithmetic as float ops ending in a Clip to the
    format, which ``convert_qat_model`` recognises (``QATLayer._export_input``'s form)."""

    def __init__(self, aq: nn.Module) -> None:
        super().__init__()
        self.aq = aq

    def forward(self, x: Tensor) -> Tensor:
        return exported_input_quant(self.aq, x)


class RecurrentQAT(RecurrentLayer):
    """Mixin of the recurrent QAT classes, listed before the torch class
    (``LSTMQAT(RecurrentQAT, nn.LSTM)``). Subclasses set ``_layer_cls`` and call
    ``_setup_qat(config)`` after the torch constructor."""

    _layer_cls: type[nn.Module]

    def _setup_qat(self, config) -> None:
        cls = self._layer_cls
        why = unsupported(self)
        if why is not None:
            raise ValueError(f"proj_size: {type(self).__name__}: {why}")
        if self.weight_ih_l0.dtype != torch.float32:
            raise ValueError(f"dtype: {type(self).__name__} trains float32 weights, got {self.weight_ih_l0.dtype}")
        qat = parse_qat_config(config, cls.__name__)
        self.config = config  # upstream's attribute: the dict as given
        self.qat_config: QatConfig = qat
        self.layer_type = cls.__name__
        if qat.quant is None:
            self.attach_quantizers(None, None)
            return
        act = qat.quant.act
        self.attach_quantizers(make_act_quantizer(act, bool(act.fixed_min), qat.batch_num),
                               make_weight_quantizer(qat.quant.wts))

    @classmethod
    def from_float(cls, mod: nn.Module, config=None) -> RecurrentQAT:
        """A QAT module computing what ``mod`` (exactly a ``_layer_cls``) computes, with its own
        copy of ``mod``'s weights (``mod`` is left as it was), quantized as ``config`` says."""
        want = cls._layer_cls
        if type(mod) is not want:
            got = type(mod).__name__ if isinstance(mod, nn.Module) else type(mod).__name__ + " (not a module)"
            extra = " (it is already a quantized layer)" if isinstance(mod, RecurrentLayer) else ""
            raise TypeError(f"mod: {cls.__name__}.from_float expects a torch.nn.{want.__name__}, got {got}{extra}")
        why = unsupported(mod)
        if why is not None:
            raise ValueError(f"mod: {why}")
        parse_qat_config(config, want.__name__)  # a bad config fails before anything is built
        w = mod.weight_ih_l0
        kwargs = {k: getattr(mod, k) for k in ("input_size", "hidden_size", "num_layers", "bias", "batch_first",
                                                "dropout", "bidirectional")}
        qat = cls(**kwargs, device=w.device, dtype=w.dtype, config=config)
        with torch.no_grad():
            for name, p in mod.named_parameters(recurse=False):
                getattr(qat, name).copy_(p)
                getattr(qat, name).requires_grad_(p.requires_grad)
        for m in (qat.x_quant, qat.h_quant, qat.wts_quant):
            m.to(w.device)
        qat.train(mod.training)
        return qat

    def forward(self, input: Tensor, hx=None):
        if self.act_quant is None:  # retrain_enable false: the float layer
            return self._layer_cls.forward(self, input, hx)
        if not graph_mode():
            return super().forward(input, hx)  # RecurrentLayer's: the graph flow's numerics
        if torch.compiler.is_exporting():
            raise ValueError(f"{type(self).__name__}: export with torch.onnx.export(..., dynamo=False); the dynamo "
                             "exporter cannot compute its int8 weights (fake tensors)")
        # Exported: the int8 weights are computed here, outside the trace (constants of the
        # file), and the input quantizers write their int8 Q/DQ pairs.
        with untraced(), torch.no_grad():
            deploy = RecurrentDeploy(self, x_pre=nn.ModuleDict({k: _ExportInput(q) for k, q in self.x_quant.items()}))
        return deploy(input, hx)

    def extra_repr(self) -> str:
        q = self.qat_config.quant
        base = self._layer_cls.extra_repr(self)
        if q is None:
            return base + ", retrain_enable=False"
        return base + (f", data={q.act.dst_type}, weights={q.wts.dst_type} {q.wts.algo.upper()}"
                       f"{' per gate row' if q.wts.channel_wise else ''}")
