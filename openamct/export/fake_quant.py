"""The fake-quant model: float ONNX that reproduces the compressed model in eval mode.

Weights are stored as float holding the fake-quantized values (``effective_weight_bias``: BN
folded, 2:4 mask applied, ARQ/ULQ applied). Each input quantizer becomes explicit float ops,
Mul(1/s) -> Round -> Add(zp) -> Clip(-128, 127) -> Sub(zp) -> Mul(s) (upstream AMCT's form), which
is exactly the arithmetic of torch's CPU fake_quantize kernel: ``inv_scale = 1.0f / scale`` in
float32, ``nearbyint`` (ONNX Round is also half-to-even), integer zero point, clamp, then
``(q - zp) * scale``. So the only differences left between ONNX Runtime and PyTorch are the
float ops themselves (conv/matmul accumulation order, softmax, layer norm), never the quantizers.

Measured (ORT 1.32 vs torch 2.13 CPU, models trained 3 steps, example inputs, 6 seeds): Net001
<= 1, ResBlockNet <= 4, MobileNetV2Tiny <= 2, UNetTiny <= 2, TinyTransformerBlock 0 float32 ulps
of the output range. On large batches a conv whose ORT and oneDNN sums differ by an ulp now and
then lands a value on the other side of a rounding midpoint of the next quantizer: that element
moves one quantization step and the output differs there by much more than ulps (batch 64 of
random inputs: Net001 10 of 640 output values, UNetTiny 8 of 131k, seed-dependent). That is
float arithmetic, not the export; the quantizer itself is bit-exact (tests check it on ties).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from torch import Tensor, nn

from openamct.compressed.layer import CompressedLayer
from openamct.export.export_layer import fold_activations, fold_layers
from openamct.export.int4_onnx import fake_int4_extras
from openamct.export.recurrent import fold_recurrent
from openamct.formats import INT8_ACT, QuantFormat
from openamct.quant.covering_pool import fold_pools
from openamct.techniques.base import ExportParts, Technique

logger = logging.getLogger(__name__)

__all__ = ["FakeQuantAct", "fold_fake_quant", "fold_plain"]


class FakeQuantAct(nn.Module):
    """Activation fake quant (``fmt``: INT8) written as six float ONNX ops (see the module docstring)."""

    def __init__(self, scale: float, offset: int, fmt: QuantFormat = INT8_ACT) -> None:
        super().__init__()
        self.qmin, self.qmax = fmt.qmin, fmt.qmax
        s = np.float32(scale)
        self.scale = float(s)
        self.inv_scale = float(np.float32(1.0) / s)  # float32 division, as torch's kernel
        self.offset = float(int(offset))

    def forward(self, x: Tensor) -> Tensor:
        q = (x * self.inv_scale).round() + self.offset
        return (q.clamp(self.qmin, self.qmax) - self.offset) * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale:.8g}, offset={int(self.offset)}"


def _fake_layer(name: str, layer: CompressedLayer, w: Tensor, parts: ExportParts) -> dict:
    # An INT4 weight goes out as grid values read by DequantizeLinear (export/int4_onnx.py).
    return {"pre": None if parts.input_quant is None else FakeQuantAct(*parts.input_quant),
            "post": None if parts.output_quant is None else FakeQuantAct(*parts.output_quant),
            **fake_int4_extras(layer, w, parts)}


def _plain_layer(name: str, layer: CompressedLayer, w: Tensor, parts: ExportParts) -> dict:
    return {}


def fold_fake_quant(model: nn.Module, techniques: Sequence[Technique], defer=None) -> nn.Module:
    """Turn a working copy of a compressed model into its fake-quant export model (in place);
    ``defer``: see ``fold_layers``."""
    fold_layers(model, _fake_layer, techniques, defer)
    fold_recurrent(model, FakeQuantAct)
    fold_activations(model, FakeQuantAct)
    fold_pools(model)
    return model


def fold_plain(model: nn.Module, techniques: Sequence[Technique]) -> nn.Module:
    """Prune-only models: plain float layers with masks/pruning folded into the weights."""
    fold_layers(model, _plain_layer, techniques)  # written from memory (writer.py)
    fold_pools(model)
    return model
