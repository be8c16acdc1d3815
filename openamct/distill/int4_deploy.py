"""4-bit weights in the deploy ONNX: what the export writes as an int8 initializer holding INT4
grid values (-8..7) -> DequantizeLinear (one scale per output row) -> Gemm/MatMul becomes a
weight ONNX Runtime stores and runs as 4 bits.

* ``"matmulnbits"`` (the default; measured the faster, docs/distill.md): each such Linear becomes
  ``com.microsoft.MatMulNBits(A, B, scales)``, B the weights as unsigned 4-bit (q + 8, the
  operator's default zero point) packed two to a byte in blocks of ``block_size`` along the
  input features, the row's scale repeated per block; a bias becomes an ``Add`` after it.
* ``"dq_int4"``: the initializer becomes an ONNX INT4 tensor (opset 21 DequantizeLinear reads
  it); the model is converted to opset 21 (``onnx.version_converter``), the graph otherwise unchanged.

Only weights whose DequantizeLinear feeds a Linear (``Gemm`` with transB, or
``Transpose``+``MatMul``) are rewritten; any other INT4 weight keeps its 8-bit storage.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["pack_int4_weights", "FORMATS"]

FORMATS = ("matmulnbits", "dq_int4")


def _block_size(k: int) -> int:
    for bs in (128, 64, 32, 16):
        if k % bs == 0:
            return bs
    return 16  # K is padded to a multiple (the padding holds zero weights)


def _pack(q: np.ndarray, bs: int) -> np.ndarray:
    """[N, K] int values in -8..7 -> [N, ceil(K/bs), bs/2] uint8, low nibble first."""
    n, k = q.shape
    blocks = -(-k // bs)
    u = np.full((n, blocks * bs), 8, dtype=np.uint8)
    u[:, :k] = (q.astype(np.int16) + 8).astype(np.uint8)
    pairs = u.reshape(n, blocks * bs // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(n, blocks, bs // 2).astype(np.uint8)


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            out.setdefault(name, []).append(node)
    return out


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _linear_of(dq: onnx.NodeProto, users: dict) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """(the Gemm/MatMul using the dequantized weight as W^T, nodes to drop) or None."""
    after = users.get(dq.output[0], [])
    if len(after) != 1:
        return None
    user = after[0]
    if (user.op_type == "Gemm" and list(user.input).index(dq.output[0]) == 1 and _attr(user, "transB", 0) == 1
            and _attr(user, "transA", 0) == 0 and _attr(user, "alpha", 1.0) == 1.0 and _attr(user, "beta", 1.0) == 1.0):
        return user, []
    if user.op_type == "Transpose" and list(_attr(user, "perm", [1, 0])) == [1, 0]:
        nxt = users.get(user.output[0], [])
        if len(nxt) == 1 and nxt[0].op_type == "MatMul" and nxt[0].input[1] == user.output[0]:
            return nxt[0], [user]
    return None


def pack_int4_weights(model: onnx.ModelProto, fmt: str = "matmulnbits", accuracy_level: int = 0) -> int:
    """Rewrite ``model`` (in place) so its Linear INT4 weights are stored as 4 bits; returns how
    many were rewritten. ``accuracy_level`` (MatMulNBits): 0 computes in float from the unpacked
    weights; 4 lets ORT quantize the activations to int8 per block and use its int8 kernels."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if fmt == "dq_int4" and any(o.domain in ("", "ai.onnx") and o.version < 21 for o in model.opset_import):
        from onnx import version_converter

        # The whole graph moves to opset 21 (ReduceL2's axes became an input at 18, ...).
        model.CopyFrom(version_converter.convert_version(model, 21))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    users = _consumers(graph)
    done = 0
    drop: list[onnx.NodeProto] = []
    for dq in [n for n in graph.node if n.op_type == "DequantizeLinear"]:
        w = inits.get(dq.input[0])
        if w is None or w.data_type != onnx.TensorProto.INT8 or len(w.dims) != 2 or len(dq.input) < 2:
            continue
        q = numpy_helper.to_array(w)
        scale = inits.get(dq.input[1])
        if scale is None or q.min() < -8 or q.max() > 7 or _attr(dq, "axis", 1) != 0:
            continue
        found = _linear_of(dq, users)
        if found is None:
            continue
        user, extra = found
        s = numpy_helper.to_array(scale).astype(np.float32).reshape(-1)
        n, k = q.shape
        if s.size not in (1, n):
            continue
        s = np.broadcast_to(s, (n,))
        if fmt == "dq_int4":
            w.CopyFrom(helper.make_tensor(w.name, onnx.TensorProto.INT4, list(w.dims), q.flatten().tolist()))
            if len(dq.input) > 2 and dq.input[2] in inits:
                z = inits[dq.input[2]]
                z.CopyFrom(helper.make_tensor(z.name, onnx.TensorProto.INT4, list(z.dims),
                                              numpy_helper.to_array(z).flatten().tolist()))
            done += 1
            continue
        bs = _block_size(k)
        packed = _pack(q, bs)
        blocks = packed.shape[1]
        base = w.name.removesuffix("_int8")
        graph.initializer.extend([numpy_helper.from_array(packed, base + "_q4"),
                                  numpy_helper.from_array(np.repeat(s, blocks).astype(np.float32), base + "_q4_scales")])
        out = user.output[0]
        bias = user.input[2] if user.op_type == "Gemm" and len(user.input) > 2 and user.input[2] else None
        mm_out = out + "_nbits" if bias else out
        new = [helper.make_node("MatMulNBits", [user.input[0], base + "_q4", base + "_q4_scales"], [mm_out],
                                name=(user.name or base) + "_MatMulNBits", domain="com.microsoft", K=k, N=n, bits=4,
                                block_size=bs, accuracy_level=accuracy_level)]
        if bias:
            new.append(helper.make_node("Add", [mm_out, bias], [out], name=(user.name or base) + "_bias"))
        at = list(graph.node).index(user)
        for i, node in enumerate(new):
            graph.node.insert(at + i, node)
        drop += [user, dq, *extra]
        graph.initializer.remove(w)
        done += 1
    for node in drop:
        graph.node.remove(node)
    if done and fmt == "matmulnbits" and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    if done and fmt == "dq_int4":
        model.ir_version = max(model.ir_version, 10)
    _drop_unused(graph)
    return done


def _drop_unused(graph: onnx.GraphProto) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)
