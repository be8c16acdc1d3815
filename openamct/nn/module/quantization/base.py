"""``QATLayer``: what every single-op QAT module (Conv2dQAT, LinearQAT...) adds to its torch class.

A QAT module is a ``CompressedLayer`` with an input quantizer, a weight quantizer and an output
range observer and nothing else (no BN folded, no mask): the class ``create_quant_retrain_model``
puts in a model, so its forward, its gradients and its eval-mode int32-grid bias are the graph
flow's code, and one layer trained either way gives the same weights. The quantizers come from
the config (``config.parse_qat_config``) through the graph flow's own factories.

Exported with plain ``torch.onnx.export`` (either exporter), a module writes
QuantizeLinear/DequantizeLinear pairs: int8 (per tensor) on its input, int8 (per channel or
per tensor, zero point 0) on its weight (an INT16 input: the same arithmetic as float ops,
see ``_export_input``), and, once its output observer has seen a training
batch, a uint8 pair on its output carrying the observed range per output channel (from which
the deploy model bounds the range of a conv output that no quantizer reads, through the
BatchNorm it folds). ``convert_qat_model`` reads those three; it removes the uint8 pair from
the fake-quant model.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch
from torch import Tensor, nn

from openamct.compressed.layer import CompressedLayer
from openamct.formats import QAT_MODULE_ACTIVATION_FORMATS, UINT8_ACT
from openamct.nn.module.quantization.config import QatConfig, parse_qat_config
from openamct.quant.functions import graph_mode, ulq_qparams
from openamct.quant.quantizers import ActULQ, RangeObserver, WeightULQ
from openamct.techniques.quantization import make_weight_quantizer

logger = logging.getLogger(__name__)

__all__ = ["QATLayer", "MARKER_QMIN", "MARKER_QMAX", "CONV_FIELDS", "CONV_TRANSPOSE_FIELDS"]

# The output-range pair: the deploy activation format (uint8), unlike the int8 quantizers.
MARKER_QMIN, MARKER_QMAX = UINT8_ACT.qmin, UINT8_ACT.qmax


# ``QATLayer._ctor_fields`` of the convolutions and the transposed ones.
CONV_FIELDS = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
               "padding_mode")
CONV_TRANSPOSE_FIELDS = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "output_padding",
                         "groups", "dilation", "padding_mode")



def exported_input_quant(aq: ActULQ, x: Tensor) -> Tensor:
    """``aq`` applied to ``x`` as the export writes it: Q/DQ up to 8 bits; wider formats as float
    ops (Mul by 1/s, Round, Add zp, Clip to the format, Sub zp, Mul s), exact in integers."""
    fmt = aq.format
    if fmt.bits <= 8:
        return aq(x)
    s, zp, _, _ = ulq_qparams(aq.clip_max, aq.clip_min, aq.fixed_min, fmt)
    q = torch.clamp(torch.round(x * torch.reciprocal(s)) + zp, fmt.qmin, fmt.qmax)
    return (q - zp) * s

class QATLayer(CompressedLayer):
    """Mixin of the QAT classes, listed before the torch class (``Conv2dQAT(QATLayer, nn.Conv2d)``).
    Subclasses set ``_layer_cls`` (the torch class) and call ``_setup_qat(config)`` after the
    torch constructor."""

    _layer_cls: type[nn.Module]

    def _setup_qat(self, config) -> None:
        """Check ``config`` and add the quantizers (the torch constructor has run)."""
        cls = self._layer_cls
        qat = parse_qat_config(config, cls.__name__)
        if self.weight.dtype != torch.float32:
            raise ValueError(f"dtype: {type(self).__name__} trains float32 weights, got {self.weight.dtype}")
        if getattr(self, "padding_mode", "zeros") != "zeros":
            raise ValueError(f"padding_mode: {type(self).__name__} supports 'zeros' only, got {self.padding_mode!r}")
        self.config = config  # upstream's attribute: the dict as given
        self.qat_config: QatConfig = qat
        transposed = bool(getattr(self, "transposed", False))
        self.kind = ("conv_transpose" if transposed else "conv") + f"{len(self.kernel_size)}d" \
            if hasattr(self, "kernel_size") else "linear"
        self.spatial = len(self.kernel_size) if hasattr(self, "kernel_size") else 0
        self.layer_type = cls.__name__
        self.weight_axis = 1 if transposed else 0
        self.weight_groups = getattr(self, "groups", 1)
        self.bn = self.sparsity = self.out_quant = None
        self.mask_names, self.input_on_grid, self._scales_seen, self.large = (), False, None, None
        self.act_quant = self.wts_quant = self.out_observer = None
        if qat.quant is None:
            return
        if transposed and self.weight_groups > 1:
            raise ValueError(f"groups: {type(self).__name__} with groups > 1 has no per-axis weight quantization "
                             f"in ONNX (its output channels are not one axis of the weight); got {self.groups}")
        device = self.weight.device
        act = qat.quant.act
        # make_act_quantizer's arguments, with the format looked up among the modules' own
        # (INT16 included, which the graph flow's ActSpec.format refuses)
        fmt = QAT_MODULE_ACTIVATION_FORMATS[act.dst_type]
        self.act_quant = ActULQ(clip_max=act.clip_max, clip_min=act.clip_min, fixed_min=bool(act.fixed_min),
                                batch_num=qat.batch_num, fmt=fmt).to(device)
        wq = make_weight_quantizer(qat.quant.wts)
        wq.bind(self.weight_axis, self.weight_groups)
        self.wts_quant = wq.to(device)
        if isinstance(wq, WeightULQ) and not self.weight.is_meta:
            wq.init_from(self.weight.detach())  # as CompressedLayer.from_parts: final shape before any optimizer
        channels, axis = (self.out_features, -1) if self.kind == "linear" else (self.out_channels, 1)
        self.out_observer = RangeObserver(channels=channels, axis=axis).to(device)

    # The torch constructor's arguments (bias, device and dtype aside) that rebuild a module of
    # ``_layer_cls`` in ``from_float``: its attributes of the same names.
    _ctor_fields: tuple[str, ...] = ()

    @classmethod
    def from_float(cls, mod: nn.Module, config=None) -> QATLayer:
        """A QAT module computing what ``mod`` (exactly a ``_layer_cls``) computes, with its own
        copy of ``mod``'s weight and bias (``mod`` is left as it was), quantized as ``config`` says."""
        want = cls._layer_cls
        if type(mod) is not want:
            got = type(mod).__name__ if isinstance(mod, nn.Module) else type(mod).__name__ + " (not a module)"
            extra = " (it is already a quantized layer)" if isinstance(mod, CompressedLayer) else ""
            raise TypeError(f"mod: {cls.__name__}.from_float expects a torch.nn.{want.__name__}, got {got}{extra}")
        parse_qat_config(config, want.__name__)  # a bad config fails before anything is built
        kwargs = {k: getattr(mod, k) for k in cls._ctor_fields}
        qat = cls.__new__(cls)
        want.__init__(qat, **kwargs, bias=mod.bias is not None, device="meta", dtype=mod.weight.dtype)
        qat.weight = nn.Parameter(mod.weight.detach().clone(), requires_grad=mod.weight.requires_grad)
        if mod.bias is not None:
            qat.bias = nn.Parameter(mod.bias.detach().clone(), requires_grad=mod.bias.requires_grad)
        qat._setup_qat(config)
        qat.train(mod.training)
        return qat

    def forward(self, x: Tensor) -> Tensor:
        if self.act_quant is None:  # retrain_enable false: the float layer
            return self._layer_cls.forward(self, x)
        if not graph_mode():
            return super().forward(x)  # CompressedLayer's: the graph flow's training and eval numerics
        # Exported: the ops the ONNX exporters write as Q/DQ, with no read of a buffer's value
        # (torch.export traces fake tensors). The eval bias rounding to the int32 grid is left
        # to convert_qat_model, which computes it from the exported scales as the layer does.
        y = self._op(self._export_input(x), self.wts_quant(self.weight), self.bias)
        obs = self.out_observer
        if torch.compiler.is_exporting() or _observed(obs):
            # per output channel: convert_qat_model bounds the range of the BatchNorm folded
            # after it channel by channel
            lo, hi = obs.min_val.float().clamp(max=0.0), obs.max_val.float().clamp(min=0.0)
            s = ((hi - lo) / UINT8_ACT.levels).clamp(min=float(np.finfo(np.float32).eps))
            zp = torch.round(-lo / s).clamp(MARKER_QMIN, MARKER_QMAX).to(torch.int32)
            y = torch.fake_quantize_per_channel_affine(y, s, zp, obs.axis % y.dim(), MARKER_QMIN, MARKER_QMAX)
        return y

    def _check_output_size(self, x: Tensor, output_size) -> None:
        """A transposed conv's ``output_size`` (upstream's forward takes it): accepted when it is
        the size the module's ``output_padding`` gives, since the quantized forward and the ONNX
        file carry one fixed output padding; else a ValueError saying which one it needs."""
        if output_size is None:
            return
        need = tuple(self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size,
                                          len(self.kernel_size), self.dilation))
        if need != tuple(self.output_padding):
            raise ValueError(f"output_size: {list(output_size)} needs output_padding {need}, but this "
                             f"{type(self).__name__} was built with output_padding {tuple(self.output_padding)}: build "
                             f"it with output_padding={need} (keyword) for that size")

    def _export_input(self, x: Tensor) -> Tensor:
        """The input quantizer as exported: Q/DQ for INT8; for a wider format, which no torch
        exporter writes as Q/DQ, the same arithmetic as float ops (Mul by 1/s, Round, Add zp,
        Clip to the format, Sub zp, Mul s: ``fake_quant_per_tensor``'s, in exact integers),
        which ``convert_qat_model`` recognises by the Clip bounds."""
        return exported_input_quant(self.act_quant, x)

    def extra_repr(self) -> str:
        q = self.qat_config.quant
        if q is None:
            return self._layer_cls.extra_repr(self) + ", retrain_enable=False"
        return (self._layer_cls.extra_repr(self) + f", data={q.act.dst_type}, weights={q.wts.dst_type} "
                f"{q.wts.algo.upper()}{' per channel' if q.wts.channel_wise else ''}")


def _observed(obs: RangeObserver) -> bool:
    """Whether the output observer has seen data. Read under the TorchScript tracer on purpose:
    an observer that has seen nothing writes no output marker into the file, so the value is a
    constant of the export, and the tracer's warning about it would only alarm the user."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return bool(obs.initialized)
