"""``dynamic_quantize_lstm``: rewrite a deploy model's LSTMs into ONNX Runtime's integer
``com.microsoft.DynamicQuantizeLSTM``.

The deploy model (``export/recurrent.py``) holds each LSTM's weights as int8 initializers read
through ``DequantizeLinear`` (per row, zero point 0), so ORT runs a float LSTM on dequantized
weights. ``DynamicQuantizeLSTM`` keeps them int8 and quantizes the input and the hidden state
per step itself (uint8, from each step's range): integer matmuls, but ORT-only (OpenVINO and
other runtimes do not know the contrib op) and LSTM-only (ORT has no such GRU). Which is faster
depends on the sizes: docs/export.md has the figures. The file's weights and scales are the
same; only the activations' rounding differs (dynamic, not the trained clips).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from openamct.export.element_types import numpy_dtype
from openamct.formats import INT8_WEIGHT

__all__ = ["dynamic_quantize_lstm"]

_INT8 = numpy_dtype(INT8_WEIGHT)  # DynamicQuantizeLSTM's weights are int8

DOMAIN = "com.microsoft"


def _dq_weights(nodes_by_out: dict, inits: dict, name: str) -> tuple[np.ndarray, np.ndarray, list] | None:
    """(int8 [D, rows, cols], scales [D, rows], nodes to drop) of a weight as the deploy writer
    reads it: per direction, Unsqueeze(Concat(DequantizeLinear(int8 [gate rows, cols], per row)
    per gate block)), and a Concat of the directions; None for anything else."""
    node = nodes_by_out.get(name)
    if node is None:
        return None
    heads = [nodes_by_out.get(i) for i in node.input] if node.op_type == "Concat" else [node]
    drop = [node] if node.op_type == "Concat" else []
    qs, ss = [], []
    for head in heads:
        cat = None if head is None or head.op_type != "Unsqueeze" else nodes_by_out.get(head.input[0])
        if cat is None or cat.op_type != "Concat":
            return None
        parts = [nodes_by_out.get(i) for i in cat.input]
        drop += [head, cat, *parts]
        q_rows, s_rows = [], []
        for p in parts:
            if p is None or p.op_type != "DequantizeLinear" or any(i not in inits for i in p.input[:3]):
                return None
            q, sc, z = (numpy_helper.to_array(inits[i]) for i in p.input[:3])
            if q.dtype != _INT8 or q.ndim != 2 or np.any(z != 0):
                return None
            q_rows.append(q)
            s_rows.append(np.broadcast_to(sc, (q.shape[0],)))
        qs.append(np.concatenate(q_rows))
        ss.append(np.concatenate(s_rows))
    return np.stack(qs), np.stack(ss).astype(np.float32), drop


def dynamic_quantize_lstm(src: str, dst: str) -> int:
    """Write ``src`` (a deploy ONNX file) to ``dst`` with every LSTM whose weights are int8
    DequantizeLinear initializers replaced by ``DynamicQuantizeLSTM``; returns how many (a
    ValueError, nothing written, when there is none)."""
    model = onnx.load(src)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    by_out = {o: n for n in g.node for o in n.output}
    new_nodes, dropped, done = [], set(), 0
    replaced = {}
    for n in g.node:
        if n.op_type != "LSTM" or n.domain not in ("", "ai.onnx"):
            continue
        w, r = _dq_weights(by_out, inits, n.input[1]), _dq_weights(by_out, inits, n.input[2])
        if w is None or r is None:
            continue
        ins = list(n.input) + [""] * (8 - len(n.input))
        extra = []
        for tag, (q, s, drop) in (("W", w), ("R", r)):
            base = f"{n.name or n.output[0]}_{tag}"
            tensors = {f"{base}_int8": np.ascontiguousarray(q.transpose(0, 2, 1)),
                       f"{base}_scale": s, f"{base}_zero": np.zeros(s.shape, _INT8)}
            g.initializer.extend(numpy_helper.from_array(v, k) for k, v in tensors.items())
            ins[1 if tag == "W" else 2] = f"{base}_int8"
            extra += [f"{base}_scale", f"{base}_zero"]
            dropped.update(id(d) for d in drop)
        node = helper.make_node("DynamicQuantizeLSTM", ins[:8] + extra, list(n.output), name=n.name, domain=DOMAIN)
        node.attribute.extend(n.attribute)
        replaced[id(n)] = node
        done += 1
    if not done:
        raise ValueError(f"deploy_file {src!r} has no LSTM reading int8 DequantizeLinear weights (an openamct "
                         "deploy file with a quantized LSTM); GRUs have no integer ORT op")
    for n in g.node:
        if id(n) in dropped:
            continue
        new_nodes.append(replaced.get(id(n), n))
    del g.node[:]
    g.node.extend(new_nodes)
    used = {i for n in g.node for i in n.input}
    keep = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    if done and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    onnx.save(model, dst)
    return done
