"""Reading the intermediate ONNX of a model holding single-op QAT modules (``torch.onnx.export``,
either exporter) and writing its fake-quant model.

What a QAT module leaves in the file (``module.quantization.base``), after the constant
subgraphs are folded (the TorchScript exporter leaves the scale arithmetic on the clip
parameters and the weight in the graph; every node whose inputs are all constant is evaluated
here, QuantizeLinear/DequantizeLinear excepted):

- its input: ``QuantizeLinear(x, s, zp int8) -> DequantizeLinear``, per tensor (an ``ActPair``),
  or for INT16 data the same arithmetic as float ops ending in ``Clip(-32768, 32767)``;
- its weight: ``QuantizeLinear(W, s_w, 0 int8, axis) -> DequantizeLinear`` on a float
  initializer W (a ``WeightPair``), read by a Conv, ConvTranspose or Gemm (``OnnxQatLayer``), or by
  MatMul through a Transpose (a Linear on a 3-D input);
- its output, once trained: a uint8 pair with the observed output range, per output channel
  (a marker; per tensor in files of earlier versions);
- an LSTM/GRU module (``rnn_qat_base``): its input pair, and an ONNX LSTM/GRU whose weights are
  int8 constants read through DequantizeLinear (``QatGraph.recurrent``), kept as they are.

The fake-quant model reproduces the eval-mode torch model: each weight is stored fake-quantized
(torch's own kernel, so the same bits as the layer's eval forward), each bias rounded to the
int32 grid (input scale x weight scale) as ``CompressedLayer`` rounds it in eval, each input
pair written as the float ops Mul -> Round -> Add -> Clip -> Sub -> Mul (the graph flow's and
upstream's form, exactly torch's fake quant), each marker removed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from openamct.export.element_types import numpy_dtype
from openamct.export.onnx_graph import OnnxGraph
from openamct.formats import INT8_ACT, UINT8_ACT

logger = logging.getLogger(__name__)

# A QAT input pair's grid and an output-range marker's (openamct.nn.module.quantization.base).
_INT8, _UINT8 = numpy_dtype(INT8_ACT), numpy_dtype(UINT8_ACT)

__all__ = ["ActPair", "WeightPair", "OnnxQatLayer", "QatGraph", "read_qat", "write_fake_quant", "fake_weight", "skip_pair",
           "rounded_bias"]

ANCHORS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
RECURRENT = ("LSTM", "GRU", "RNN")
# What lies between a recurrent node's W/R input and its per-gate DequantizeLinear weights.
_WEIGHT_PLUMBING = ("Unsqueeze", "Concat", "Reshape", "Transpose", "Squeeze")


@dataclass
class ActPair:
    """An activation quantizer: a Q/DQ pair, or (INT16) the float ops from ``q`` (the first
    Mul) to ``dq`` (the last Mul), all listed in ``ops``."""

    q: onnx.NodeProto
    dq: onnx.NodeProto
    scale: float
    zero_point: int
    dtype: type  # np.int8 / np.int16 (a QAT input quantizer) or np.uint8 (an output-range marker)
    ops: tuple = ()
    # a marker per output channel (QuantizeLinear with an axis): each channel's scale and zero
    # point; ``scale`` / ``zero_point`` then hold the largest scale and 0
    scales: np.ndarray | None = None
    zero_points: np.ndarray | None = None

    def ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """(lows, highs) a uint8 marker represents, per channel (one entry when per tensor)."""
        s = np.atleast_1d(self.scales if self.scales is not None else np.float32(self.scale)).astype(np.float32)
        zp = np.atleast_1d(self.zero_points if self.zero_points is not None else self.zero_point).astype(np.float32)
        return (UINT8_ACT.qmin - zp) * s, (UINT8_ACT.qmax - zp) * s


@dataclass
class WeightPair:
    q: onnx.NodeProto
    dq: onnx.NodeProto
    name: str  # the float weight initializer
    scales: np.ndarray  # float32, per channel along ``axis`` or one
    axis: int | None


@dataclass
class OnnxQatLayer:
    node: onnx.NodeProto
    weight: WeightPair
    act: ActPair | None
    transpose: onnx.NodeProto | None = None  # MatMul(x, Transpose(W)): a Linear on N-D input
    marker: ActPair | None = None  # the uint8 output-range pair right after it


@dataclass
class QatGraph:
    g: OnnxGraph
    layers: list[OnnxQatLayer] = field(default_factory=list)
    acts: list[ActPair] = field(default_factory=list)
    markers: list[ActPair] = field(default_factory=list)
    recurrent: list[onnx.NodeProto] = field(default_factory=list)  # LSTM/GRU nodes on int8 weights


def _fold_constants(g: OnnxGraph) -> int:
    """Evaluate every node (Q/DQ excepted) whose inputs are all initializers."""
    from onnx.reference import ReferenceEvaluator

    g.constants_to_initializers()
    folded = 0
    for n in g.topological():
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") or n.domain not in ("", "ai.onnx") or \
                any(g.is_output(o) for o in n.output) or any(i and g.const(i) is None for i in n.input):
            continue
        outs = ReferenceEvaluator(n).run(None, {i: g.const(i) for i in n.input if i})
        for name, value in zip(n.output, outs):
            g.inits[name] = numpy_helper.from_array(np.asarray(value), name)
        g.remove(n)
        folded += 1
    return folded


def _pair(g: OnnxGraph, q: onnx.NodeProto):
    """(dq, scale array, zp array) of a Q whose one reader is a DQ with the same qparams."""
    if len(q.input) < 3:
        return None
    s, zp = g.const(q.input[1]), g.const(q.input[2])
    users = g.users(q.output[0])
    if s is None or zp is None or len(users) != 1 or users[0].op_type != "DequantizeLinear" \
            or g.is_output(q.output[0]):
        return None
    dq = users[0]
    if len(dq.input) < 3 or not np.array_equal(g.const(dq.input[1]), s) or \
            not np.array_equal(g.const(dq.input[2]), zp):
        return None
    return dq, s.astype(np.float32), zp


def read_qat(model: onnx.ModelProto, where: str = "model_file") -> QatGraph:
    """Find the QAT pattern in ``model`` (edited in place: constants folded); ValueError when
    the model has none."""
    g = OnnxGraph(model)
    _fold_constants(g)
    out = QatGraph(g)
    weights: dict[str, WeightPair] = {}
    acts: dict[str, ActPair] = {}
    for q in [n for n in g.nodes if n.op_type == "QuantizeLinear"]:
        found = _pair(g, q)
        if found is None:
            continue
        dq, s, zp = found
        src = g.const(q.input[0])
        if src is not None:
            if src.dtype == np.float32 and zp.dtype == _INT8 and not np.any(zp):
                axis = g.attr(q, "axis", 1) if s.size > 1 else None
                weights[dq.output[0]] = WeightPair(q, dq, q.input[0], s.reshape(-1), axis)
            continue
        if s.size == 1 and zp.dtype in (_INT8, _UINT8):
            pair = ActPair(q, dq, float(s.reshape(())), int(zp.reshape(())), zp.dtype.type)
            (out.markers if zp.dtype == _UINT8 else out.acts).append(pair)
            acts[dq.output[0]] = pair
        elif zp.dtype == np.uint8 and zp.size == s.size:  # an output-range marker per channel
            pair = ActPair(q, dq, float(s.max()), 0, np.uint8, scales=s.reshape(-1), zero_points=zp.reshape(-1))
            out.markers.append(pair)
            acts[dq.output[0]] = pair
    for pair in _wide_acts(g):
        out.acts.append(pair)
        acts[pair.dq.output[0]] = pair
    for n in g.topological():
        if n.op_type not in ANCHORS or len(n.input) < 2:
            continue
        w, transpose = n.input[1], None
        p = g.producer(w)
        if n.op_type == "MatMul" and p is not None and p.op_type == "Transpose":
            transpose, w = p, p.input[0]
        if w not in weights:
            continue
        if n.op_type == "Gemm" and (g.attr(n, "transA", 0) or not g.attr(n, "transB", 0)):
            continue  # torch exports a Linear as Gemm(transB=1)
        act = acts.get(n.input[0])
        layer = OnnxQatLayer(n, weights[w], act if act is not None and act.dtype != _UINT8 else None, transpose)
        users = g.users(n.output[0])
        if len(users) == 1:
            layer.marker = next((m for m in out.markers if m.q is users[0]), None)
        out.layers.append(layer)
    out.recurrent = [n for n in g.topological() if n.op_type in RECURRENT and _int8_weights(g, n)]
    if not out.layers and not out.recurrent:
        raise ValueError(f"{where}: no QAT layer found (a Conv, ConvTranspose, Gemm or MatMul reading "
                         "DequantizeLinear(QuantizeLinear(weight)) with an int8 zero point 0, or an LSTM/GRU "
                         "reading int8 DequantizeLinear weights): export a model holding "
                         "openamct.nn.module.quantization QAT modules with torch.onnx.export")
    logger.info("%s: %d QAT layers, %d recurrent QAT layers, %d input quantizers, %d output ranges", where,
                len(out.layers), len(out.recurrent), len(out.acts), len(out.markers))
    return out


def _int8_weights(g: OnnxGraph, n: onnx.NodeProto) -> bool:
    """Whether a recurrent node's input weights W come from DequantizeLinear of int8
    constants (what ``LSTMQAT``/``GRUQAT`` export), through the ops that stack the gates."""
    todo, seen = [n.input[1]] if len(n.input) > 1 else [], set()
    while todo:
        name = todo.pop()
        p = g.producer(name)
        if p is None or name in seen:
            continue
        seen.add(name)
        if p.op_type == "DequantizeLinear":
            c = g.const(p.input[0])
            if c is not None and c.dtype == np.int8:
                return True
        elif p.op_type in _WEIGHT_PLUMBING:
            todo.extend(i for i in p.input if i)
    return False


def _const_operand(g: OnnxGraph, n, value_first: bool = False):
    """(the non-constant input, the constant scalar) of a binary node, or None."""
    if n is None or len(n.input) != 2:
        return None
    a, b = n.input
    ca, cb = g.const(a), g.const(b)
    if cb is not None and ca is None and cb.size == 1:
        return a, float(cb.reshape(()))
    if ca is not None and cb is None and ca.size == 1 and n.op_type in ("Mul", "Add"):
        return b, float(ca.reshape(()))
    return None


def _wide_acts(g: OnnxGraph) -> list[ActPair]:
    """INT16 input quantizers, written by a QAT module as Mul(x, 1/s) -> Round -> Add(zp) ->
    Clip(-32768, 32767) -> Sub(zp) -> Mul(s) (``QATLayer._export_input``)."""
    found = []
    for clip in [n for n in g.nodes if n.op_type == "Clip" and len(n.input) == 3]:
        lo, hi = g.const(clip.input[1]), g.const(clip.input[2])
        if lo is None or hi is None or (float(lo), float(hi)) != (-32768.0, 32767.0):
            continue
        add = g.producer(clip.input[0])
        a = _const_operand(g, add) if add is not None and add.op_type == "Add" else None
        rnd = g.producer(a[0]) if a else None
        mul = g.producer(rnd.input[0]) if rnd is not None and rnd.op_type == "Round" else None
        m = _const_operand(g, mul) if mul is not None and mul.op_type == "Mul" else None
        users = g.users(clip.output[0])
        sub = users[0] if len(users) == 1 and users[0].op_type == "Sub" else None
        sb = _const_operand(g, sub) if sub is not None else None
        users = g.users(sub.output[0]) if sub is not None else []
        last = users[0] if len(users) == 1 and users[0].op_type == "Mul" else None
        ml = _const_operand(g, last) if last is not None else None
        if not (a and m and sb and ml) or a[1] != sb[1] or g.is_output(clip.output[0]):
            continue
        found.append(ActPair(mul, last, ml[1], int(a[1]), np.int16, (mul, rnd, add, clip, sub, last)))
    return found


def fake_weight(g: OnnxGraph, w: WeightPair) -> np.ndarray:
    """The weight fake-quantized by torch's kernel with the exported scales (the layer's eval
    weight, bit for bit)."""
    wt = torch.from_numpy(np.array(g.const(w.name), dtype=np.float32))
    zp = g.const(w.q.input[2])
    qmin, qmax = int(np.iinfo(zp.dtype).min), int(np.iinfo(zp.dtype).max)
    s = torch.from_numpy(w.scales.copy())
    if w.axis is None:
        y = torch.fake_quantize_per_tensor_affine(wt, float(s[0]), 0, qmin, qmax)
    else:
        y = torch.fake_quantize_per_channel_affine(wt, s, torch.zeros(s.numel(), dtype=torch.int32),
                                                   w.axis % wt.dim(), qmin, qmax)
    return y.numpy()


def rounded_bias(g: OnnxGraph, layer: OnnxQatLayer) -> tuple[str, np.ndarray] | None:
    """(name, values) of the layer's bias rounded to the int32 grid as ``CompressedLayer``'s
    ``_bias_on_int32_grid`` rounds it in eval (float32: sx * sw, round half to even)."""
    n = layer.node
    if layer.act is None or n.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(n.input) < 3 or not n.input[2]:
        return None
    b = g.const(n.input[2])
    if b is None or b.dtype != np.float32:
        return None
    scale = np.float32(layer.act.scale) * layer.weight.scales.astype(np.float32)
    q = np.round(b / scale)
    return n.input[2], (q * scale).astype(np.float32) if np.all(np.abs(q) < 2**31 - 1) else b


def skip_pair(g: OnnxGraph, pair: ActPair) -> None:
    """Remove a Q/DQ pair: its readers read its input."""
    g.replace_uses(pair.dq.output[0], pair.q.input[0])
    g.remove(pair.dq)
    g.remove(pair.q)


def write_fake_quant(qg: QatGraph) -> None:
    """Turn ``qg``'s graph into the fake-quant model (module docstring); writes the model back."""
    g = qg.g
    for layer in qg.layers:
        rb = rounded_bias(g, layer)
        if rb is not None:
            g.set_input(layer.node, 2, g.add_init(rb[1], rb[0] + "_rounded"))
        name = g.add_init(fake_weight(g, layer.weight), layer.weight.name + "_fake_quant")
        g.replace_uses(layer.weight.dq.output[0], name)
    for m in qg.markers:
        skip_pair(g, m)
    for a in qg.acts:
        if a.ops:  # INT16: already the float form
            continue
        s = np.float32(a.scale)
        qmin, qmax = int(np.iinfo(a.dtype).min), int(np.iinfo(a.dtype).max)
        consts = [g.add_init(np.array(v, np.float32), f"{a.q.input[0]}_fq_{k}") for k, v in
                  (("inv_scale", np.float32(1.0) / s), ("offset", np.float32(a.zero_point)),
                   ("qmin", np.float32(qmin)), ("qmax", np.float32(qmax)), ("scale", s))]
        t = g.make("Mul", [a.q.input[0], consts[0]])
        t = g.make("Round", [t.output[0]])
        t = g.make("Add", [t.output[0], consts[1]])
        t = g.make("Clip", [t.output[0], consts[2], consts[3]])
        t = g.make("Sub", [t.output[0], consts[1]])
        t = g.make("Mul", [t.output[0], consts[4]])
        g.replace_uses(a.dq.output[0], t.output[0])
        g.remove(a.dq)
        g.remove(a.q)
    g.finish()
