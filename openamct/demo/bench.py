"""What the demo measures on its ONNX files: accuracy and latency in ONNX Runtime (the session
and timing of :mod:`openamct.export.ort_session`), size and how many weights each stores.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from openamct.export.int8_kernels import warn_if_u8s8_saturates
from openamct.export.ort_session import THREADS, latency_ms, session

logger = logging.getLogger(__name__)

__all__ = ["LATENCY_BATCH", "LATENCY_RUNS", "measure", "onnx_accuracy", "session", "weight_counts"]

LATENCY_BATCH, LATENCY_RUNS = 64, 100
_WEIGHT_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul"}


def onnx_accuracy(sess, x: torch.Tensor, y: torch.Tensor, batch: int = 250) -> float:
    """Top-1 accuracy of a one-input, one-output classifier session on ``x`` / ``y``."""
    name = sess.get_inputs()[0].name
    correct = 0
    for start in range(0, len(x), batch):
        logits = sess.run(None, {name: x[start:start + batch].numpy()})[0]
        correct += int((logits.argmax(axis=1) == y[start:start + batch].numpy()).sum())
    return correct / len(x)


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


def measure(paths: dict[str, str], macs: dict[str, int], x_te, y_te) -> tuple[list[dict], dict]:
    """One row per model of ``paths`` (the first is the baseline of speed-up and size ratios),
    and the latency settings."""
    import onnxruntime as ort

    sessions = {k: session(p) for k, p in paths.items()}
    lat = latency_ms(sessions, x_te[:LATENCY_BATCH].numpy(), runs=LATENCY_RUNS)
    base = next(iter(paths))
    base_size = os.path.getsize(paths[base])
    models = []
    for k, p in paths.items():
        params, nonzero = weight_counts(p)
        size = os.path.getsize(p)
        models.append({"name": k, "file": os.path.basename(p), "accuracy": onnx_accuracy(sessions[k], x_te, y_te),
                       "size_bytes": size, "params": params, "nonzero": nonzero, "macs": macs[k],
                       "latency_ms": lat[k], "speedup": lat[base] / lat[k], "smaller": base_size / size})
    return models, {"batch": LATENCY_BATCH, "runs": LATENCY_RUNS, "threads": THREADS,
                    "ort_version": ort.__version__, "u8s8_saturates": warn_if_u8s8_saturates()}
