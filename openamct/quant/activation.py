"""``QuantizedActivation``: a Sigmoid, SiLU, Hardswish or Hardsigmoid module with INT8
quantizers around it, so the tensors between two layers are integers in the deploy model
(QLinearSigmoid, QLinearMul) and the fake-quant model computes the same grid values.

SiLU is written as ``y * sigmoid(y)`` with ``y = q_in(x)``, which is how the ONNX exporter
writes it (Sigmoid, Mul), Hardswish as ``y * hardsigmoid(y)``: quantizing the Sigmoid output (``q_inner``) and, when no quantized
layer reads the result, the Mul output (``q_out``) gives ORT a DQ -> op -> Q around each op.
The same class serves export: the quantizers are then swapped for FakeQuantAct / QDQAct
(``with_quantizers``), so training, fake-quant and deploy run one forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["KINDS", "QuantizedActivation"]

KINDS = ("silu", "sigmoid", "hardswish", "hardsigmoid")
# kind -> its gate; SiLU and Hardswish multiply their input by it. ORT's CPU provider has no int8
# HardSigmoid kernel: it runs in float between its Q/DQ, as in quantize_static's graph (which
# writes Hardswish as x * HardSigmoid(x) too), and the Mul after it as QLinearMul.
GATES = {"silu": torch.sigmoid, "sigmoid": torch.sigmoid, "hardswish": F.hardsigmoid, "hardsigmoid": F.hardsigmoid}
SELF_GATED = ("silu", "hardswish")


class QuantizedActivation(nn.Module):
    _openamct_leaf = True  # one op for graph capture, like the module it replaces

    def __init__(self, kind: str, q_in: nn.Module, q_inner: nn.Module | None = None,
                 q_out: nn.Module | None = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        if kind in SELF_GATED and q_inner is None:
            raise ValueError(f"q_inner: a {kind} needs the quantizer of its gate's output")
        self.kind = kind
        self.q_in, self.q_inner, self.q_out = q_in, q_inner, q_out

    def quantizers(self) -> dict[str, nn.Module]:
        return {k: q for k in ("q_in", "q_inner", "q_out") if (q := getattr(self, k)) is not None}

    def forward(self, x: Tensor) -> Tensor:
        y = self.q_in(x)
        s = GATES[self.kind](y)
        out = y * self.q_inner(s) if self.kind in SELF_GATED else s
        return out if self.q_out is None else self.q_out(out)

    def with_quantizers(self, make: Callable[[float, int], nn.Module]) -> QuantizedActivation:
        """A copy whose quantizers are ``make(scale, offset)`` of each trained one (export)."""
        qs = {k: make(*q.scale_offset()) for k, q in self.quantizers().items()}
        return QuantizedActivation(self.kind, **qs)

    def extra_repr(self) -> str:
        return f"{self.kind}, quantizers={list(self.quantizers())}"
