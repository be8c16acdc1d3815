"""Where the deploy post-pass (``deploy.py``) puts the Q/DQ pair after an integer-capable op:
read the activation quantizers that follow it through ops that map grid values to grid values,
else fall back to a value range. Kept apart from the pass's other steps."""

from __future__ import annotations

import numpy as np
import onnx

from openamct.export.element_types import numpy_dtype
from openamct.export.onnx_graph import OnnxGraph
from openamct.formats import INT8_ACT, UINT8_ACT

_INT8, _UINT8 = numpy_dtype(INT8_ACT), numpy_dtype(UINT8_ACT)  # the grids integer kernels read

PASS_OPS = {"Relu", "Clip", "MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity"}


def qparams(g: OnnxGraph, q: onnx.NodeProto) -> tuple | None:
    s, zp = g.const(q.input[1]), g.const(q.input[2]) if len(q.input) > 2 else None
    if s is None or zp is None or s.size != 1 or zp.dtype not in (_INT8, _UINT8):
        return None  # (a single-op INT16 input pair feeds a float kernel: not an integer-kernel input)
    return float(s.reshape(())), int(zp.reshape(())), zp.dtype


def _act_qs(g: OnnxGraph, tensor: str) -> list:
    return [n for n in g.users(tensor) if n.op_type == "QuantizeLinear" and qparams(g, n) is not None]


def dedupe(g: OnnxGraph) -> None:
    for op in ("QuantizeLinear", "DequantizeLinear"):
        seen: dict = {}
        for n in list(g.nodes):
            if n.op_type != op or g.const(n.input[0]) is not None:
                continue
            p = qparams(g, n)
            if p is None:
                continue
            key = (n.input[0], p)
            if key in seen:
                g.replace_uses(n.output[0], seen[key].output[0])
                g.remove(n)
            else:
                seen[key] = n


def drop_requantize(g: OnnxGraph) -> int:
    """Q(DQ(q)) with the very qparams of that DQ is q: a layer reading a tensor that an output
    hook already put on its grid (quant/residual.py) exports its own Q/DQ once more."""
    dropped = 0
    for q in [n for n in g.nodes if n.op_type == "QuantizeLinear"]:
        dq = g.producer(q.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or g.is_output(q.output[0]):
            continue
        p = qparams(g, q)
        if p is not None and p == qparams(g, dq):
            g.replace_uses(q.output[0], dq.input[0])
            g.remove(q)
            dropped += 1
    return dropped


def nearest_resize(g: OnnxGraph, op: onnx.NodeProto) -> bool:
    """A nearest-neighbour Resize copies values: what it reads on a grid it returns on it."""
    return op.op_type == "Resize" and g.attr(op, "mode", b"nearest") in (b"nearest", "nearest")


def passes(g: OnnxGraph, op: onnx.NodeProto) -> bool:
    """Ops that map grid values to grid values; a constant Pad with 0 too (0 is on every uint8
    grid: it is the zero point), e.g. HF's TF-style "same" padding before a strided conv."""
    if op.op_type in PASS_OPS or nearest_resize(g, op):
        return True
    if op.op_type != "Pad" or g.attr(op, "mode", b"constant") not in (b"constant", "constant"):
        return False
    value = g.const(op.input[2]) if len(op.input) > 2 and op.input[2] else None
    return value is None or (value.size == 1 and float(value.reshape(())) == 0.0)


AVG_POOLS = ("AveragePool", "GlobalAveragePool")


def _on_grid(g: OnnxGraph, t: str, p: tuple) -> bool:
    c = g.producer(t)
    return c is not None and c.op_type == "Concat" and all(
        (d := g.producer(i)) is not None and d.op_type == "DequantizeLinear" and qparams(g, d) == p for i in c.input)


def _pools_onto(g: OnnxGraph, op: onnx.NodeProto, p: tuple) -> bool:
    """A MaxPool whose output only input quantizers of qparams ``p`` read (GoogLeNet's pool
    branch, which shares the other branches' quantizer): on DQ(Q(t)) ORT pools uint8."""
    if op.op_type != "MaxPool" or len(op.output) != 1 or g.is_output(op.output[0]):
        return False
    users = g.users(op.output[0])
    return bool(users) and all(u.op_type == "QuantizeLinear" and qparams(g, u) == p for u in users)


def _pools_into_concat(g: OnnxGraph, op: onnx.NodeProto, t: str, p: tuple) -> bool:
    """A MaxPool of ``t``, on the grid ``p`` (``_on_grid``), that Concats alone read
    (Inception's max-pool branches): its output is on that grid too, so a Q/DQ of ``p`` after
    it is exact and the next Concat reads DQs only (QLinearConcat requantizes each input)."""
    if op.op_type != "MaxPool" or len(op.output) != 1 or g.is_output(op.output[0]) or not _on_grid(g, t, p):
        return False
    users = g.users(op.output[0])
    return bool(users) and all(u.op_type == "Concat" for u in users)


def _walk(g: OnnxGraph, y: str):
    """Follow pass-through ops from ``y`` (each tensor read by one of them, plus Adds) to a
    tensor read only by input quantizers with one qparams (and Adds). Returns (chain, final Q,
    adds reading that tensor) or None."""
    chain, t, branched = [], y, False
    while not g.is_output(t):
        users = g.users(t)
        qs = _act_qs(g, t)
        params = {qparams(g, q) for q in qs}
        if qs and len(params) == 1:
            adds = [u for u in users if u not in qs]
            p = next(iter(params))
            # an average pool reads DQ(Q(t)) only where t is on that grid already (a Concat of
            # DQs of these qparams): fake-quant averages t itself
            if all(u.op_type == "Add" or _pools_onto(g, u, p) or _pools_into_concat(g, u, t, p) or
                   u.op_type in AVG_POOLS and _on_grid(g, t, p) for u in adds):
                return chain, qs[0], adds
            return None
        # A tensor also read by residual Adds (MobileNetV2's block output: the next block's
        # TF pad -> expand conv, and its Add): follow the one other reader. place puts a Q/DQ
        # on every tensor of the chain but the last, so these Adds then read DQ(Q(t)). Only
        # where no Relu/Clip follows, whose quantizer's range would clip what the Add reads.
        others = [u for u in users if u.op_type != "Add" or any(g.const(i) is not None for i in u.input)]
        if len(others) != 1 or not passes(g, others[0]) or len(others[0].output) != 1:
            return None  # (a MaxPool with an indices output is not a pass-through)
        if len(others) < len(users):
            branched = True
        if branched and others[0].op_type in ("Relu", "Clip"):
            return None
        chain.append(others[0])
        t = others[0].output[0]
    return None


def _skippable(g: OnnxGraph, op: onnx.NodeProto, p: tuple) -> bool:
    """ORT drops a Relu/Clip right before a Q whose representable range lies inside it."""
    s, zp, dtype = p
    lo, hi = (np.iinfo(dtype).min - zp) * s, (np.iinfo(dtype).max - zp) * s
    if op.op_type == "Relu":
        return lo >= 0.0
    if op.op_type == "Clip":
        cmin = g.const(op.input[1]) if len(op.input) > 1 and op.input[1] else None
        cmax = g.const(op.input[2]) if len(op.input) > 2 and op.input[2] else None
        return (cmin is None or lo >= float(cmin)) and (cmax is None or hi <= float(cmax))
    return False


def _uint8(lo: float, hi: float) -> tuple[float, int]:
    """The deploy activation format's (scale, zero point) of the range [lo, hi] (lo <= 0 <= hi)."""
    f = UINT8_ACT
    s = float(max(np.float32(hi - lo) / np.float32(f.levels), np.finfo(np.float32).eps))
    return s, int(np.clip(np.rint(f.qmin - lo / s), f.qmin, f.qmax))


def _fallback(g: OnnxGraph, y: str, rng: tuple[float, float]) -> bool:
    """Q/DQ from a value range (an output observer's, or an Add's input bound); behind a Relu
    that follows, with the range clipped at 0, so ORT drops the Relu and the step is finer."""
    lo, hi = rng
    users = g.users(y)
    if len(users) == 1 and users[0].op_type in ("Relu", "Clip") and not g.is_output(y):
        op = users[0]
        cmin = g.const(op.input[1]) if op.op_type == "Clip" and len(op.input) > 1 and op.input[1] else None
        cmax = g.const(op.input[2]) if op.op_type == "Clip" and len(op.input) > 2 and op.input[2] else None
        lo = max(lo, 0.0 if op.op_type == "Relu" else float(cmin) if cmin is not None else lo)
        hi = min(hi, float(cmax)) if cmax is not None else hi
        y = op.output[0]
    if g.is_output(y):
        return False
    s, zp = _uint8(min(lo, 0.0), max(hi, 0.0))
    g.insert_qdq(y, s, zp, _UINT8)
    return True


def place(g: OnnxGraph, y: str, rng: tuple[float, float] | None, round_adds: bool = False) -> bool:
    """Quantize the output ``y`` of an integer-capable op; True when it ends up quantized.
    ``round_adds``: a residual Add reading the tensor the next quantizer reads reads its DQ(Q(t))
    too (QLinearAdd), a rounding step the training model does not take (``finish_deploy``'s
    ``all_observers``)."""
    found = _walk(g, y)
    if found is None:
        return rng is not None and _fallback(g, y, rng)
    chain, q, adds = found
    p = qparams(g, q)
    if chain and chain[0].op_type in ("Relu", "Clip") and _skippable(g, chain[0], p):
        points = [op.output[0] for op in chain[:-1]]  # layer -> Relu -> Q: ORT drops the Relu
    else:
        points = ([y] if chain else []) + [op.output[0] for op in chain[:-1]]
    for t in points:
        g.insert_qdq(t, p[0], p[1], p[2])
    dq = next((u for u in g.users(q.output[0]) if u.op_type == "DequantizeLinear"), None)
    if dq is None:
        dq = g.make("DequantizeLinear", [q.output[0], q.input[1], q.input[2]])
    for add in adds:
        if add.op_type == "Add" and not round_adds and not _on_grid(g, q.input[0], p):
            # fake-quant adds t itself: training puts a quantizer on a residual tensor wherever
            # it can name the tensor's module, and where it could not, DQ(Q(t)) here would be
            # a rounding that only the deploy file does
            continue
        if add.op_type == "MaxPool" and all(u.op_type == "Concat" for u in g.users(add.output[0])):
            g.insert_qdq(add.output[0], p[0], p[1], p[2])
        for i, name in enumerate(add.input):
            if name == q.input[0]:
                g.set_input(add, i, dq.output[0])
    return True


def splits_onto_grid(g: OnnxGraph) -> int:
    """A Split/Slice of DQ(q) whose output only Concats read (ShuffleNetV2's channel split, one
    half passed on to the next concat): a Q/DQ of those qparams on that output. Exact (a part of
    a tensor on a grid is on it); ORT then runs the split on uint8 and the Concat as
    QLinearConcat (each input a DequantizeLinear). Returns how many."""
    placed = 0
    for op in [n for n in g.nodes if n.op_type in ("Split", "Slice")]:
        dq = g.producer(op.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or g.const(dq.input[0]) is not None:
            continue
        p = qparams(g, dq)
        if p is None:
            continue
        for out in op.output:
            users = g.users(out)
            if out and users and not g.is_output(out) and all(u.op_type == "Concat" for u in users):
                g.insert_qdq(out, p[0], p[1], p[2])
                placed += 1
    return placed


def resizes_onto_grid(g: OnnxGraph) -> int:
    """A nearest-neighbour Resize of DQ(q) (HRNet's fuse layers upsample a conv's quantized
    output into a sum) gets a Q/DQ of those qparams on its output. Exact (it copies values); ORT
    then resizes the uint8 tensor and, where its readers are Adds of quantized tensors, runs
    them as QLinearAdd. Returns how many."""
    placed = 0
    for op in [n for n in g.nodes if nearest_resize(g, n)]:
        dq = g.producer(op.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or g.const(dq.input[0]) is not None:
            continue
        p = qparams(g, dq)
        out = op.output[0]
        users = g.users(out)
        if p is None or g.is_output(out) or not users or any(u.op_type == "QuantizeLinear" for u in users):
            continue
        g.insert_qdq(out, p[0], p[1], p[2])
        placed += 1
    return placed
