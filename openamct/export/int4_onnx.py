"""INT4 weights (A8W4) in the two ONNX files: stored as 4-bit values, not int8 holding them.

Both writers first store an INT4 layer's weight as what the deploy model has always stored: an
int8 initializer of grid values (-8..7, ``<layer>.weight_int8``; an LSTM/GRU weight
``<layer>.weight_ih_l0_int8`` in the fake-quant file, one per gate block
``<layer>.weight_ih_l0_g0_int8`` in the deploy file) read by a per-channel ``DequantizeLinear``
(zero point 0). The fake-quant writer does so too for INT4 layers only (``fake_int4_extras``),
so its float op reads DQ(q) = q x s, the very values of the float fake-quant weight. Then, on
the ONNX:

* ``native_int4``: those initializers become ``TensorProto.INT4`` (two values a byte in the
  file), read by opset-21 ``DequantizeLinear``; the model is converted to opset 21
  (``onnx.version_converter``: ReduceMean's axes and the like move to inputs), since the
  TorchScript exporter writes opset 20 at most and INT4 DequantizeLinear needs 21. The
  fake-quant file gets this for every INT4 weight; the deploy file for those ``pack_int4_weights``
  leaves (convolutions, LSTM/GRU gate blocks).
* ``pack_int4_weights(..., "matmulnbits")``: a weight whose DequantizeLinear feeds a Linear
  (``Gemm`` with transB, or ``Transpose`` + ``MatMul``) becomes ``com.microsoft.MatMulNBits(A,
  B, scales)``, B the weights as unsigned 4-bit (q + 8, the operator's default zero point)
  packed two to a byte in blocks of ``block_size`` along the input features, the row's scale
  repeated per block; a bias becomes an ``Add`` after it. This is ONNX Runtime's 4-bit Linear
  (distillation's deploy model used it first: ``openamct.distill.int4_deploy``).

The names of the INT4 initializers come from the model before export (``int4_initializers``):
an int8 weight of an INT8 layer is never rewritten, whatever its values.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper
from torch import Tensor, nn

from openamct.compressed.layer import CompressedLayer
from openamct.compressed.recurrent import GATES, RecurrentLayer
from openamct.export.export_layer import WeightDQ, per_channel_view
from openamct.techniques.base import ExportParts

logger = logging.getLogger(__name__)

__all__ = ["FORMATS", "INT4_OPSET", "is_int4", "fake_int4_extras", "int4_initializers", "native_int4",
           "pack_int4_weights", "finish_int4_deploy"]

FORMATS = ("matmulnbits", "dq_int4")
INT4_OPSET = 21  # the first opset whose DequantizeLinear reads INT4


def is_int4(fmt) -> bool:
    return fmt is not None and fmt.bits == 4 and fmt.signed


def fake_int4_extras(layer: CompressedLayer, w: Tensor, parts: ExportParts) -> dict:
    """The fake-quant writer's extras for an INT4 layer (module docstring): its weight stored as
    grid values and read through DequantizeLinear. {} for any other layer, and for a grouped
    ConvTranspose, whose output channels are no single axis of the weight (it stays float)."""
    fmt = parts.weight_format
    if not is_int4(fmt) or parts.weight_scales is None:
        return {}
    if not parts.weight_per_channel:
        dq = WeightDQ(parts.weight_scales, None, fmt)
    else:
        w2, axis = per_channel_view(w, layer)
        if w2.shape != w.shape:
            return {}
        dq = WeightDQ(parts.weight_scales, axis, fmt)
    return {"quantize": dq, "weight_fn": dq}


def int4_initializers(model: nn.Module) -> set[str]:
    """The initializer names the two files give the INT4 weights of ``model`` (a compressed
    model, before folding): see the module docstring."""
    names: set[str] = set()
    for name, m in model.named_modules():
        if isinstance(m, RecurrentLayer):
            for w, q in m.wts_quant.items():
                if is_int4(q.format):
                    names.add(f"{name}.{w}_int8")
                    names.update(f"{name}.{w}_g{j}_int8" for j in range(GATES[m.mode]))
        elif isinstance(m, CompressedLayer) and m.wts_quant is not None and is_int4(m.wts_quant.format):
            names.add(f"{name}.weight_int8")
    return names


def _to_opset(model: onnx.ModelProto, opset: int) -> None:
    if any(o.domain in ("", "ai.onnx") and o.version < opset for o in model.opset_import):
        from onnx import version_converter

        model.CopyFrom(version_converter.convert_version(model, opset))
    model.ir_version = max(model.ir_version, 10)  # IR 10 brought INT4


def _int4_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    q = numpy_helper.to_array(t)
    return helper.make_tensor(t.name, onnx.TensorProto.INT4, list(t.dims), q.flatten().tolist())


def _gemm_not_matmul(model: onnx.ModelProto, dq: onnx.NodeProto) -> bool:
    """Rewrite MatMul(A, Transpose(DQ(w))) as Gemm(A as 2-D, DQ(w), transB=1), reshaped back.

    ONNX Runtime (1.32, default optimization level) fuses DequantizeLinear(INT4) -> MatMul into
    ``MatMulNBits`` at accuracy level 4, which quantizes A to int8 per block: the fake-quant file
    then no longer computes what torch computes (a Linear 4 -> 8: 6e-3 off, against 3e-6 for
    the same weights read by Gemm, which it leaves alone)."""
    g = model.graph
    users = _consumers(g)
    found = _linear_of(dq, users)
    if found is None or found[0].op_type != "MatMul":
        return False
    mm, (tr,) = found
    a, y, base = mm.input[0], mm.output[0], dq.output[0]
    n_shape = base + "_n"  # A as [-1, K] (K from the weight's shape), Y back as [..., N]
    nodes = [
        helper.make_node("Shape", [dq.output[0]], [base + "_wshape"]),
        helper.make_node("Slice", [base + "_wshape", base + "_one", base + "_two"], [base + "_k"]),
        helper.make_node("Concat", [base + "_minus1", base + "_k"], [base + "_ashape"], axis=0),
        helper.make_node("Reshape", [a, base + "_ashape"], [base + "_a2"]),
        helper.make_node("Gemm", [base + "_a2", dq.output[0]], [base + "_y2"], transB=1),
        helper.make_node("Shape", [a], [base + "_lead_all"]),
        helper.make_node("Slice", [base + "_lead_all", base + "_zero", base + "_minus1"], [base + "_lead"]),
        helper.make_node("Slice", [base + "_wshape", base + "_zero", base + "_one"], [n_shape]),
        helper.make_node("Concat", [base + "_lead", n_shape], [base + "_yshape"], axis=0),
        helper.make_node("Reshape", [base + "_y2", base + "_yshape"], [y]),
    ]
    g.initializer.extend(numpy_helper.from_array(np.array([v], np.int64), base + sfx)
                         for v, sfx in ((-1, "_minus1"), (0, "_zero"), (1, "_one"), (2, "_two")))
    at = list(g.node).index(mm)
    for i, node in enumerate(nodes):
        g.node.insert(at + i, node)
    g.node.remove(mm)
    g.node.remove(tr)
    return True


def native_int4(model: onnx.ModelProto, names: set[str] | None = None, reproduce: bool = False) -> int:
    """Store every int8 initializer read by a DequantizeLinear (its zero point too) as
    ``TensorProto.INT4``, in place; ``names``: only those (None: every one whose values lie in
    -8..7). Converts ``model`` to opset 21 first when there is one; returns how many.
    ``reproduce`` (the fake-quant file): Linears read them through Gemm (``_gemm_not_matmul``)."""
    inits = {i.name: i for i in model.graph.initializer}
    todo = []
    for dq in (n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.domain in ("", "ai.onnx")):
        w = inits.get(dq.input[0])
        if w is None or w.data_type != onnx.TensorProto.INT8 or (names is not None and w.name not in names):
            continue
        q = numpy_helper.to_array(w)
        if q.size and (q.min() < -8 or q.max() > 7):
            continue
        todo.append(dq)
    if not todo:
        return 0
    _to_opset(model, INT4_OPSET)
    inits = {i.name: i for i in model.graph.initializer}
    dqs = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    for out in [dq.output[0] for dq in todo]:
        dq = dqs[out]  # (the converter's copy of the node)
        w = inits[dq.input[0]]
        w.CopyFrom(_int4_tensor(w))
        if len(dq.input) > 2 and dq.input[2]:
            # Its own INT4 zero point: the exporter shares equal int8 constants between nodes
            # (through Identity), and the int8 one may serve an int8 weight too.
            shape = list(inits[dq.input[1]].dims) if dq.input[1] in inits else []
            zero = helper.make_tensor(w.name + "_zero4", onnx.TensorProto.INT4, shape, [0] * int(np.prod(shape)))
            model.graph.initializer.append(zero)
            dq.input[2] = zero.name
        if reproduce:
            _gemm_not_matmul(model, dq)
    _drop_unused(model.graph)
    return len(todo)


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


def pack_int4_weights(model: onnx.ModelProto, fmt: str = "matmulnbits", accuracy_level: int = 0,
                      names: set[str] | None = None) -> int:
    """Rewrite ``model`` (in place) so its Linear INT4 weights are stored as 4 bits (module
    docstring); returns how many were rewritten. ``names``: the INT4 weights' initializers
    (None: every int8 DequantizeLinear weight whose values lie in -8..7). ``accuracy_level``
    (MatMulNBits): 0 computes in float from the unpacked weights; 4 lets ORT quantize the
    activations to int8 per block and use its int8 kernels."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    users = _consumers(graph)
    linear: list[tuple] = []
    for dq in [n for n in graph.node if n.op_type == "DequantizeLinear" and n.domain in ("", "ai.onnx")]:
        w = inits.get(dq.input[0])
        if w is None or w.data_type != onnx.TensorProto.INT8 or len(w.dims) != 2 or len(dq.input) < 2:
            continue
        if names is not None and w.name not in names:
            continue
        q = numpy_helper.to_array(w)
        scale = inits.get(dq.input[1])
        # per output row (axis 0) or one scale (the axis then means nothing)
        if scale is None or q.min() < -8 or q.max() > 7 or (_attr(dq, "axis", 1) != 0 and np.prod(scale.dims) != 1):
            continue
        found = _linear_of(dq, users)
        s = numpy_helper.to_array(scale).astype(np.float32).reshape(-1)
        if found is None or s.size not in (1, q.shape[0]):
            continue
        linear.append((dq, w, q, np.broadcast_to(s, (q.shape[0],)), *found))
    if fmt == "dq_int4":
        return native_int4(model, {w.name for _, w, *_ in linear})
    drop: list[onnx.NodeProto] = []
    for dq, w, q, s, user, extra in linear:
        n, k = q.shape
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
    for node in drop:
        graph.node.remove(node)
    if linear and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _drop_unused(graph)
    return len(linear)


def finish_int4_deploy(model: onnx.ModelProto, names: set[str] | None, accuracy_level: int = 0) -> tuple[int, int]:
    """The deploy file's INT4 weights as 4 bits, in place: ``MatMulNBits`` for the Linears,
    INT4 DequantizeLinear for the rest. ``names``: their initializers (None: every int8 weight
    whose values lie in -8..7). Returns (MatMulNBits, INT4 DequantizeLinear) counts."""
    if names is not None and not names:
        return 0, 0
    nbits = pack_int4_weights(model, "matmulnbits", accuracy_level, names)
    rest = native_int4(model, names)
    logger.info("deploy: %d INT4 Linear weights as MatMulNBits, %d as INT4 DequantizeLinear", nbits, rest)
    return nbits, rest


def _drop_unused(graph: onnx.GraphProto) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)
