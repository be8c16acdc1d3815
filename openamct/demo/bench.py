"""What the demo measures on an ONNX file: accuracy and latency in ONNX Runtime, and how many
weights it stores.

Latency: CPU provider, 2 intra-op threads, the models timed in interleaved rounds (order
alternating) and the median taken, so a burst of load from other processes hits every model
alike instead of whichever happened to run then.
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np
import onnx
import torch
from onnx import numpy_helper

logger = logging.getLogger(__name__)

__all__ = ["THREADS", "session", "onnx_accuracy", "latency_ms", "weight_counts"]

THREADS = 2
_WEIGHT_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul"}


def session(path: str, threads: int = THREADS):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # Spinning worker threads buy an idle machine a few percent, but on a shared one they burn
    # the cores other processes need and made medians swing 3x between runs (measured here).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def onnx_accuracy(sess, x: torch.Tensor, y: torch.Tensor, batch: int = 250) -> float:
    """Top-1 accuracy of a one-input, one-output classifier session on ``x`` / ``y``."""
    name = sess.get_inputs()[0].name
    correct = 0
    for start in range(0, len(x), batch):
        logits = sess.run(None, {name: x[start:start + batch].numpy()})[0]
        correct += int((logits.argmax(axis=1) == y[start:start + batch].numpy()).sum())
    return correct / len(x)


def latency_ms(sessions: dict, x: np.ndarray, runs: int = 100, warmup: int = 5) -> dict[str, float]:
    """Median wall time (ms) of one ``run`` on ``x`` per session, timed in interleaved rounds."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    feeds = {k: {s.get_inputs()[0].name: x} for k, s in sessions.items()}
    for k, s in sessions.items():
        for _ in range(warmup):
            s.run(None, feeds[k])
    times: dict[str, list[float]] = {k: [] for k in sessions}
    keys = list(sessions)
    for r in range(runs):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            t0 = time.perf_counter()
            sessions[k].run(None, feeds[k])
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def weight_counts(path: str) -> tuple[int, int]:
    """(stored, non-zero) elements of the weights and biases of Conv/Gemm/MatMul nodes, found
    directly as initializers or behind a DequantizeLinear (the deploy model's int8 weights)."""
    model = onnx.load(path)
    inits = {t.name: t for t in model.graph.initializer}
    producers = {out: n for n in model.graph.node for out in n.output}
    seen: set[str] = set()
    stored = nonzero = 0
    for node in model.graph.node:
        if node.op_type not in _WEIGHT_OPS:
            continue
        for name in node.input[1:3]:
            src = producers.get(name)
            if name not in inits and src is not None and src.op_type == "DequantizeLinear":
                name = src.input[0]
            if name in inits and name not in seen:
                seen.add(name)
                arr = numpy_helper.to_array(inits[name])
                stored += arr.size
                nonzero += int(np.count_nonzero(arr))
    return stored, nonzero
