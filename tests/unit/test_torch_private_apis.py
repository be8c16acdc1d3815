"""torch functions openamct reads that torch does not document as public: each is checked to
exist and to do what openamct relies on, so a torch upgrade that changes one fails here, by
name, instead of somewhere deep in an export or a training step."""

from __future__ import annotations

import torch

from openamct.nn.module.quantization.rnn_qat_base import untraced


def test_a_paused_trace_records_nothing_and_resumes():
    """``untraced`` (the single-op LSTM/GRU modules' int8 weights, computed during a legacy
    ONNX export) rests on ``torch._C._get_tracing_state`` / ``_set_tracing_state``."""
    assert callable(getattr(torch._C, "_get_tracing_state", None))
    assert callable(getattr(torch._C, "_set_tracing_state", None))

    def fn(x):
        with untraced():
            hidden = torch.sin(x) * 3.0  # computed, but a constant of the trace
        return torch.cos(x) + hidden

    x = torch.randn(4)
    traced = torch.jit.trace(fn, x, check_trace=False)
    kinds = [n.kind() for n in traced.graph.nodes()]
    assert "aten::cos" in kinds and "aten::sin" not in kinds and "aten::mul" not in kinds, kinds
    assert torch.allclose(traced(x), fn(x))
    assert torch._C._get_tracing_state() is None  # restored after the trace
