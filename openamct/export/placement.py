"""``placement="latency"`` at save time: keep a block float in the deploy file where its INT8
form runs slower than its float form on this machine's ONNX Runtime (CPU provider).

A block is one quantized Conv or Gemm of the deploy file: its int8 weight read through a
DequantizeLinear, its input through a Q/DQ pair. Its INT8 form is what ORT fuses there: the
input's Q/DQ, the integer kernel, and the output's Q/DQ (through a Relu/Clip) where one follows;
its float form is the float kernel on the dequantized weight, which the fake-quant model
computes too. Depthwise and tiny convs, whose integer kernels and Q/DQ pairs cost more than the
float arithmetic they save, are the candidates. Which blocks lose depends on the CPU: torchvision
MobileNetV3-Large's INT8 file ran at 0.87x FP32 on one 2-core Xeon and 1.04x on another, hence a
measurement on the machine that saves rather than a fixed rule.

Each block is timed alone, both forms interleaved (``openamct.export.ort_session.latency_ms``),
on the activation it reads when the deploy file runs ``input_data``. Then three whole files are
timed the same way: the INT8 deploy file, the file with the blocks the per-block timings chose
kept float, and the file with every block float. The fastest is written (the INT8 file unless
another is at least ``MARGIN``, 5 %, faster; medians of 3 measurements), so the written deploy
file is never measured slower than the INT8 one, nor than its all-float form (FP32 speed).

A block kept float: its weight (and bias) become the float initializers DequantizeLinear would
compute, bit for bit; the Q/DQ pairs that then neither an integer kernel nor an integer
producer use are dropped, so a float region runs as plain float ops. There the deploy file skips
the activation rounding the fake-quant model takes: a rounding step on a well-conditioned net,
not a different function (tests/unit/test_placement.py bounds it).

The decision goes into the deploy file's ``metadata_props`` under ``METADATA_KEY`` (JSON: the
runtime, the file chosen, the whole-file and per-block times, the layers kept float) and into
the log (INFO). The timing function is a parameter (``timer``) so that a test can give the
planner times it knows; the default times in ORT on this machine.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from openamct.export.onnx_graph import OnnxGraph
from openamct.export.qdq_place import PASS_OPS, qparams

logger = logging.getLogger(__name__)

__all__ = ["METADATA_KEY", "PLACEMENTS", "Timer", "check_placement", "latency_placement", "ort_timer",
           "placement_summary", "read_decision"]

PLACEMENTS = ("latency",)
METADATA_KEY = "openamct_placement"
MARGIN = 0.05  # another file replaces the INT8 one only when at least 5 % faster (timing noise)
Timer = Callable[[dict, dict], dict]  # {label: ModelProto}, feeds -> {label: ms}

# ops ORT runs on uint8 between a DQ and a Q, which a float region's walk looks through
_THROUGH = PASS_OPS | {"Pad", "Resize", "Split", "Slice"}
# ops ORT fuses into an integer kernel when every input is a DequantizeLinear's output
_INTEGER_OPS = {"Conv", "Gemm", "MatMul", "Add", "Mul", "Concat", "AveragePool", "GlobalAveragePool", "Sigmoid"}


def check_placement(placement) -> None:
    """``placement``: None (the INT8 deploy file as it is) or ``"latency"``."""
    if placement is None:
        return
    if not isinstance(placement, str):
        raise TypeError(f"placement must be None or a str, got {type(placement).__name__}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is not known: use None or one of {list(PLACEMENTS)}")


def ort_timer(models: dict, feeds: dict, runs: int = 10, min_s: float = 0.2, repeat: int = 3) -> dict:
    """ms per run of each model in ONNX Runtime (2 threads, no spinning), interleaved rounds in
    alternating order, the median over ``repeat`` measurements with fresh sessions (one
    measurement of two identical files swung 0.9-1.1x on a shared 2-core machine)."""
    from openamct.export.ort_session import latency_ms, session

    reps = []
    for _ in range(repeat):
        sessions = {k: session(m.SerializeToString()) for k, m in models.items()}
        reps.append(latency_ms(sessions, feeds, runs=runs, min_s=min_s))
    return {k: float(np.median([r[k] for r in reps])) for k in models}


@dataclass
class _Block:
    name: str
    node: onnx.NodeProto
    x: str  # the float tensor its input Q reads
    head: list  # input Q, DQ
    consts: list  # the DequantizeLinear of its weight (and of its int32 bias)
    tail: list = field(default_factory=list)  # Relu/Clip, Q, DQ after it that ORT fuses


def _is_act_dq(g: OnnxGraph, n) -> bool:
    return n is not None and n.op_type == "DequantizeLinear" and g.const(n.input[0]) is None


def _layer_name(weight: str) -> str:
    return weight[: -len(".weight_int8")] if weight.endswith(".weight_int8") else weight


def _blocks(g: OnnxGraph) -> list[_Block]:
    found = []
    for n in g.topological():
        if n.op_type not in ("Conv", "Gemm") or len(n.input) < 2:
            continue
        wdq, dq = g.producer(n.input[1]), g.producer(n.input[0])
        if wdq is None or wdq.op_type != "DequantizeLinear" or g.const(wdq.input[0]) is None:
            continue
        q = g.producer(dq.input[0]) if _is_act_dq(g, dq) else None
        if q is None or q.op_type != "QuantizeLinear" or qparams(g, q) is None:
            continue
        consts = [wdq]
        if len(n.input) > 2 and n.input[2] and (b := g.producer(n.input[2])) is not None:
            if b.op_type != "DequantizeLinear" or g.const(b.input[0]) is None:
                continue  # (a bias computed in the graph: not a block this planner can rebuild)
            consts.append(b)
        block = _Block(_layer_name(wdq.input[0]), n, q.input[0], [q, dq], consts)
        t = n.output[0]
        users = g.users(t)
        if len(users) == 1 and users[0].op_type in ("Relu", "Clip") and not g.is_output(t):
            block.tail.append(users[0])
            t = users[0].output[0]
            users = g.users(t)
        if len(users) == 1 and users[0].op_type == "QuantizeLinear" and not g.is_output(t):
            dqs = [u for u in g.users(users[0].output[0]) if u.op_type == "DequantizeLinear"]
            block.tail += [users[0], *dqs[:1]] if dqs else []
        if block.tail and block.tail[-1].op_type != "DequantizeLinear":
            block.tail = []  # a Relu alone: the float form has it too, so it is left out of both
        found.append(block)
    return found


def _dequantized(g: OnnxGraph, dq) -> np.ndarray:
    """What ``dq`` (a DequantizeLinear of a constant) computes: (q - zp) * scale in float32."""
    q, s = g.const(dq.input[0]), g.const(dq.input[1]).astype(np.float32)
    zp = g.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else np.zeros_like(s, dtype=q.dtype)
    if s.size > 1:
        shape = [1] * q.ndim
        axis = g.attr(dq, "axis", 1) % q.ndim
        shape[axis] = -1
        s, zp = s.reshape(shape), zp.reshape(shape)
    return ((q.astype(np.float32) - zp.astype(np.float32)) * s).astype(np.float32)


def _submodel(model: onnx.ModelProto, g: OnnxGraph, nodes: list, x: str, value: np.ndarray, out: str,
              extra: dict) -> onnx.ModelProto:
    """The graph of ``nodes`` alone: ``x`` its input (shaped as ``value``), ``out`` its output,
    the initializers they read (``extra``: name -> array, added)."""
    names = {i for n in nodes for i in n.input if i}
    inits = [g.inits[i] for i in sorted(names) if i in g.inits and i not in extra]
    inits += [numpy_helper.from_array(a, k) for k, a in extra.items()]
    graph = helper.make_graph(
        [onnx.NodeProto.FromString(n.SerializeToString()) for n in nodes], "block",
        [helper.make_tensor_value_info(x, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape))],
        [helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None)], inits)
    sub = helper.make_model(graph, opset_imports=list(model.opset_import))
    sub.ir_version = model.ir_version
    return sub


def _float_node(b: _Block) -> onnx.NodeProto:
    node = onnx.NodeProto.FromString(b.node.SerializeToString())
    node.input[0] = b.x
    node.input[1] = b.node.input[1] + "_float"
    if len(node.input) > 2 and node.input[2]:
        node.input[2] = b.node.input[2] + "_float"
    return node


def _block_forms(model: onnx.ModelProto, g: OnnxGraph, b: _Block, value: np.ndarray):
    int8_nodes = [*b.head, *b.consts, b.node, *b.tail]
    int8 = _submodel(model, g, int8_nodes, b.x, value, int8_nodes[-1].output[0], {})
    fnode = _float_node(b)
    relu = [n for n in b.tail if n.op_type in ("Relu", "Clip")]
    nodes = [fnode]
    if relu:
        r = onnx.NodeProto.FromString(relu[0].SerializeToString())
        r.input[0] = fnode.output[0]
        nodes.append(r)
    extra = {fnode.input[1]: _dequantized(g, b.consts[0])}
    if len(b.consts) > 1:
        extra[fnode.input[2]] = _dequantized(g, b.consts[1]).reshape(-1)
    return int8, _submodel(model, g, nodes, b.x, value, nodes[-1].output[0], extra)


def _activations(model: onnx.ModelProto, names: list[str], feeds: dict) -> dict[str, np.ndarray]:
    """The values of ``names`` when the model runs ``feeds`` (ORT, extra graph outputs)."""
    import onnxruntime as ort

    probe = onnx.ModelProto.FromString(model.SerializeToString())
    have = {o.name for o in probe.graph.output}
    for name in dict.fromkeys(names):
        if name not in have:
            probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = sess.run(names, feeds) if names else []
    return dict(zip(names, outs, strict=True))


# -- keeping blocks float ----------------------------------------------------------------------

def _integer(g: OnnxGraph, n) -> bool:
    """Whether ORT fuses ``n`` into an integer kernel: every input it computes on is a DQ's."""
    if n is None or n.op_type not in _INTEGER_OPS:
        return False
    data = n.input[:2] if n.op_type in ("Conv", "Gemm", "MatMul") else [i for i in n.input if i]
    if n.op_type in ("Conv", "Gemm") and len(n.input) > 1 and g.const(n.input[1]) is not None:
        return False  # a float weight: a block kept float
    return all((p := g.producer(i)) is not None and p.op_type == "DequantizeLinear" for i in data)


def _real_producer(g: OnnxGraph, t: str):
    p = g.producer(t)
    while p is not None:
        if _is_act_dq(g, p) and (q := g.producer(p.input[0])) is not None and q.op_type == "QuantizeLinear":
            p = g.producer(q.input[0])
        elif p.op_type in _THROUGH and p.input:
            p = g.producer(p.input[0])
        else:
            return p
    return None


def _real_readers(g: OnnxGraph, t: str, seen: set) -> list:
    found = []
    for u in g.users(t):
        if id(u) in seen:
            continue
        seen.add(id(u))
        if u.op_type in ("QuantizeLinear", "DequantizeLinear") or u.op_type in _THROUGH:
            for o in u.output:
                found += _real_readers(g, o, seen) if not g.is_output(o) else [None]
        else:
            found.append(u)
    return found


def _anchored(g: OnnxGraph) -> set[int]:
    """The integer ops joined (through Q/DQ pairs and ops ORT runs on uint8) to an integer
    Conv, Gemm or MatMul: an island of integer Adds or pools among float blocks would only add
    its Q and DQ to the float ops' time."""
    ops = [n for n in g.topological() if _integer(g, n)]
    parent = {id(n): id(n) for n in ops}

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for n in ops:
        for o in n.output:
            for r in _real_readers(g, o, set()):
                if r is not None and id(r) in parent:
                    parent[root(id(r))] = root(id(n))
    kept = {root(id(n)) for n in ops if n.op_type in ("Conv", "Gemm", "MatMul")}
    return {id(n) for n in ops if root(id(n)) in kept}


def _drop_unused_pairs(g: OnnxGraph) -> int:
    """Drop each activation Q -> DQ pair that no integer kernel reads or writes through (to a
    fixed point: a dropped pair can leave an Add no longer integer)."""
    dropped = 0
    while True:
        gone, live = 0, _anchored(g)
        for q in [n for n in g.topological() if n.op_type == "QuantizeLinear"]:
            dqs = g.users(q.output[0])
            if g.const(q.input[0]) is not None or g.is_output(q.output[0]) or not dqs or \
                    any(d.op_type != "DequantizeLinear" or g.is_output(d.output[0]) for d in dqs):
                continue
            readers = [r for d in dqs for r in _real_readers(g, d.output[0], set())]
            producer = _real_producer(g, q.input[0])
            if producer is not None and id(producer) in live or any(r is None or id(r) in live for r in readers):
                continue
            for d in dqs:
                g.replace_uses(d.output[0], q.input[0])
                g.remove(d)
            g.remove(q)
            gone += 1
        dropped += gone
        if not gone:
            return dropped


def _channels(g: OnnxGraph, n) -> int:
    """The channels of a Conv's input (axis 1), or a Gemm's reduced axis (axis 1 of its 2-D input)."""
    w = g.const(n.input[1])
    if n.op_type == "Conv":
        return int(w.shape[1] * g.attr(n, "group", 1))
    return int(w.shape[1] if g.attr(n, "transB", 0) else w.shape[0])


def _per_axis_input(g: OnnxGraph, n) -> bool:
    """A float block still reading a per-tensor DQ (an integer neighbour keeps its Q) reads it
    through a DQ of the same values written per channel instead. ORT's WeightBiasQuantization
    quantizes the float weight of a Conv/Gemm whose input is a per-tensor DQ's (per tensor,
    coarser than the trained per-channel grid, and back into an integer kernel); it leaves one
    reading a per-channel DQ alone."""
    dq = g.producer(n.input[0])
    if not _is_act_dq(g, dq):
        return False
    s = g.const(dq.input[1])
    zp = g.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    if s is None or s.size != 1 or zp is None:
        return False
    c = _channels(g, n)
    scale = g.add_init(np.full(c, s.reshape(()), np.float32), dq.input[1] + "_per_channel")
    zero = g.add_init(np.full(c, zp.reshape(()), zp.dtype), dq.input[2] + "_per_channel")
    g.set_input(n, 0, g.make("DequantizeLinear", [dq.input[0], scale, zero], axis=1).output[0])
    return True


def keep_float(model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """A copy of ``model`` with the blocks of these layers float (module docstring)."""
    out = onnx.ModelProto.FromString(model.SerializeToString())
    g = OnnxGraph(out)
    kept = [b for b in _blocks(g) if b.name in names]
    for b in kept:
        g.set_input(b.node, 1, g.add_init(_dequantized(g, b.consts[0]), b.node.input[1] + "_float"))
        if len(b.consts) > 1:
            g.set_input(b.node, 2, g.add_init(_dequantized(g, b.consts[1]).reshape(-1), b.node.input[2] + "_float"))
    dropped = _drop_unused_pairs(g)
    for b in kept:
        _per_axis_input(g, b.node)
    g.finish()
    logger.debug("placement: %d blocks float, %d Q/DQ pairs dropped", len(names), dropped)
    return out


# -- the planner ---------------------------------------------------------------------------------

def latency_placement(model: onnx.ModelProto, feeds: dict[str, np.ndarray], timer: Timer | None = None,
                      runtime: str | None = None) -> tuple[onnx.ModelProto, dict]:
    """The deploy file to write and the decision (module docstring). ``model`` is not changed."""
    # the default: one measurement per block (they are many and only propose), three per file
    block_timer = timer or functools.partial(ort_timer, repeat=1, min_s=0.1)
    file_timer = timer or ort_timer
    if runtime is None:
        import onnxruntime as ort

        runtime = f"onnxruntime {ort.__version__} CPUExecutionProvider, 2 threads"
    g = OnnxGraph(onnx.ModelProto.FromString(model.SerializeToString()))
    blocks = _blocks(g)
    values = dict(feeds)
    values.update(_activations(model, [b.x for b in blocks if b.x not in feeds], feeds))
    per_block, slower = {}, set()
    for b in blocks:
        int8, flt = _block_forms(model, g, b, values[b.x])
        t = block_timer({"int8": int8, "float": flt}, {b.x: values[b.x]})
        per_block[b.name] = {"int8_ms": round(t["int8"], 4), "float_ms": round(t["float"], 4)}
        if t["int8"] > t["float"]:
            slower.add(b.name)
    every = {b.name for b in blocks}
    files = {"int8": model}
    if slower and slower != every:
        files["blocks"] = keep_float(model, slower)
    if every:
        files["float"] = keep_float(model, every)
    whole = file_timer(files, feeds) if len(files) > 1 else {"int8": 0.0}
    best = min(whole, key=lambda k: whole[k])
    chosen = best if whole[best] < (1.0 - MARGIN) * whole["int8"] else "int8"
    float_layers = {"int8": set(), "blocks": slower, "float": every}[chosen]
    decision = {"placement": "latency", "runtime": runtime, "chosen": chosen,
                "model_ms": {k: round(v, 4) for k, v in whole.items()},
                "float_layers": sorted(float_layers), "blocks": per_block}
    result = onnx.ModelProto.FromString(files[chosen].SerializeToString())
    entry = result.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, json.dumps(decision, sort_keys=True)
    logger.info("%s", placement_summary(decision))
    return result, decision


def read_decision(path: str) -> dict | None:
    """The decision a deploy file records (None: saved without a placement)."""
    meta = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    return json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else None


def placement_summary(decision: dict) -> str:
    """One line for the log and ``report=``."""
    ms = decision["model_ms"]
    times = ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
    return (f"placement=latency ({decision['runtime']}): wrote the {decision['chosen']} file, "
            f"{len(decision['float_layers'])} of {len(decision['blocks'])} blocks float "
            f"({len([1 for v in decision['blocks'].values() if v['int8_ms'] > v['float_ms']])} slower in INT8 "
            f"alone); whole file: {times}")
