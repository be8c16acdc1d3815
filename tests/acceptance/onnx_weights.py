"""Read layer weights back out of saved ONNX files (float or INT8 behind DequantizeLinear)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper


def layer_weights(path: str) -> list[tuple[str, np.ndarray, int]]:
    """(node name, weight, input-channel axis) for every Conv / ConvTranspose / Gemm / MatMul
    whose weight is a constant, minding Gemm's transB and ConvTranspose's [Cin, Cout/g, ...]."""
    model = onnx.load(path)
    g = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    for n in g.node:
        if n.op_type == "Constant":
            inits[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)

    def resolve(name: str) -> np.ndarray | None:
        if name in inits:
            return inits[name]
        p = producers.get(name)
        if p is not None and p.op_type in ("DequantizeLinear", "Identity", "Cast"):
            return resolve(p.input[0])  # the stored (int8) values: zeros stay zeros
        return None

    found = []
    for n in g.node:
        if n.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or len(n.input) < 2:
            continue
        w = resolve(n.input[1])
        if w is None or w.ndim < 2:
            continue
        if n.op_type == "Conv":
            axis = 1
        elif n.op_type == "ConvTranspose":
            axis = 0
        elif n.op_type == "Gemm":
            trans_b = next((a.i for a in n.attribute if a.name == "transB"), 0)
            axis = 1 if trans_b else 0
        else:  # MatMul: x @ W with W [in, out]
            axis = w.ndim - 2
        found.append((n.name, w, axis))
    return found


def group_nonzeros(w: np.ndarray, axis: int, groups: int = 1) -> np.ndarray:
    """Non-zeros in every group of 4 consecutive entries along ``axis`` (padded to a multiple of 4)."""
    w = np.moveaxis(w, axis, -1)
    pad = (-w.shape[-1]) % 4
    w = np.concatenate([w, np.zeros(w.shape[:-1] + (pad,), w.dtype)], axis=-1)
    return (w.reshape(w.shape[:-1] + (-1, 4)) != 0).sum(-1)
