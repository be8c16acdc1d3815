"""The deploy model: the folded model exported with Q/DQ from torch, then an ONNX post-pass that
makes ONNX Runtime's CPU provider run it as integer kernels (QLinearConv, QGemm, QLinearAdd,
uint8 MaxPool, QLinear(Global)AveragePool).

Torch side: each quantized layer reads ``QDQAct(input quantizer)`` (uint8, zero point + 128) and
holds its weight as int8 already (``WeightDQ``: exports as DequantizeLinear of the int8
initializer ``<layer>.weight_int8``, per channel, zero point 0), so the export carries a quarter
of the float weight bytes; Linear layers run as 2-D Gemm (``ExportLayer.gemm_2d``). Post-pass:
1. Conv/Gemm bias -> int32
   initializer with scale = input scale x weight scale; one Q/DQ per (tensor, scale, zp); a
   part of a split quantized tensor that only Concats read gets its qparams (``splits_onto_grid``).
2. Output quantization, visiting layers (and Adds / Muls / average pools / Concats whose inputs
   are quantized) in topological order. If the output reaches, through ops that commute with
   quantization (Relu, Clip, MaxPool, Reshape, Flatten, Transpose, (Un)squeeze, constant-zero
   Pad), only input quantizers sharing one
   (scale, zp), it is quantized right there with THAT quantizer, and again after each op on the
   way so ORT sees DQ -> op -> Q. Exact: those ops map grid values to grid values and Q is
   idempotent on its grid. A Relu/Clip right after the layer is stepped over when the quantizer
   already clips there, so ORT drops it. Adds also reading that tensor (residual identity
   branches) read DQ(Q(t)) instead, so they become QLinearAdd: a rounding step fake-quant does
   not take unless training hooks that tensor (quant/residual.py; then the export already has
   its Q/DQ). Measured on ResNet-18 b8 both ways: rewired 214 vs 223 ms on a loaded machine,
   and cosine to the fake-quant model 0.999864 vs 0.999832; torchvision ResNet-50 at 224, ORT
   2 threads: without it 1.27x the latency (16 float Adds; cosine 0.9986 vs 0.9939). Training
   hooks every such tensor it can name (a module's output, also a wrapped activation's and a
   conv's through an Identity), so this now rewires only what it cannot.
   A constant-zero Pad left between Q and DQ -> Conv is then moved into the conv's padding
   (``_fuse_pads``), after folding the exporter's constant shape ops that compute its pads.
3. Otherwise a Conv's output gets its trained output-observer range (clipped at 0 behind a Relu)
   where only input quantizers and integer average pools read it, so ORT runs QLinearConv: a
   rounding step fake-quant does not take (at most one step of the readers' grid before their
   own rounding, or averaged by the pool). Where a float op reads it (``_float_read``) it stays
   float, as in fake-quant. An Add feeding an average pool gets the range its inputs bound
   (never clips; the other such step, averaged by the pool). Gemm outputs stay float: QGemm
   outputs float itself, and a Q/DQ there only costs (MLP 0.94x vs 1.05x qs).
4. A 5-D channel shuffle (ShuffleNetV2's view/transpose/view) moves H and W as one axis
   (``_flat_shuffles``): the same bytes, in a form ORT does not merge with its NHWC transposes.

Alternative measured in benchmarks/deploy_speed.py --builders: quantize_static on the folded
float model with our input scales as TensorQuantOverrides. Same ORT graph on ResNet-18, slower on
the MLP (QLinearMatMul + QLinearAdd bias + QLinearMul), and further from the fake-quant model
(cosine 0.9906 vs 0.99986 on ResNet-18, 0.9993 vs 0.999994 on the MLP): it calibrates every
tensor we have no trained scale for on ``input_data`` and re-derives weights and biases itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import onnx
from torch import Tensor, nn

from openamct.compressed.layer import CompressedLayer
from openamct.export.export_layer import (
    QDQAct,
    WeightDQ,
    fold_activations,
    fold_layers,
    per_channel_view,
)
from openamct.export.onnx_graph import OnnxGraph
from openamct.export.qdq_place import (
    AVG_POOLS,
    dedupe,
    drop_requantize,
    passes,
    place,
    qparams,
    resizes_onto_grid,
    splits_onto_grid,
)
from openamct.export.recurrent import fold_recurrent
from openamct.formats import INT8_WEIGHT
from openamct.quant.covering_pool import fold_pools
from openamct.techniques.base import ExportParts, Technique

logger = logging.getLogger(__name__)

__all__ = ["fold_deploy", "finish_deploy"]

INT_ANCHORS = {"Conv", "Gemm"}  # ORT CPU has integer kernels for these (Linear exports as Gemm)


def _weight_dq(layer: CompressedLayer, w: Tensor, parts: ExportParts) -> WeightDQ | None:
    scales = parts.weight_scales
    if scales is None:
        return None
    fmt = parts.weight_format or INT8_WEIGHT
    if not parts.weight_per_channel:
        return WeightDQ(scales, None, fmt)
    w2, axis = per_channel_view(w, layer)
    if w2.shape != w.shape:
        # Grouped ConvTranspose: Cout is not one axis of the stored weight, so no per-axis
        # DequantizeLinear expresses it; kept float (ORT's CPU EP has no integer ConvTranspose).
        logger.info("deploy: grouped %s weight kept float", layer.layer_type)
        return None
    return WeightDQ(scales, axis, fmt)


def fold_deploy(model: nn.Module, techniques: Sequence[Technique], defer=None) -> dict[str, tuple[float, float]]:
    """Fold a working copy in place (``defer``: see ``fold_layers``); return the output range (min, max) of each layer with
    an input quantizer, keyed by the weight initializer its op reads (``<layer>.weight_int8``,
    or ``<layer>.weight`` where it stays float)."""
    def build(name: str, layer: CompressedLayer, w: Tensor, parts: ExportParts) -> dict:
        pre = None if parts.input_quant is None else QDQAct(*parts.input_quant)
        post = None if parts.output_quant is None else QDQAct(*parts.output_quant)
        dq = _weight_dq(layer, w, parts)
        extras = {"pre": pre, "weight_fn": dq, "gemm_2d": True, "post": post}
        if dq is not None:
            extras["quantize"] = dq
        return extras

    found = fold_layers(model, build, techniques, defer)
    fold_recurrent(model)  # LSTM/GRU: DequantizeLinear of int8 weights -> ONNX LSTM/GRU (export/recurrent.py)
    fold_activations(model, QDQAct)
    fold_pools(model)
    return {f"{n}.{model.get_submodule(n)._wname}": p.output_range for n, p in found.items()
            if p.output_range is not None and p.input_quant is not None}


# -- post-pass ------------------------------------------------------------------------------------

def _bias_to_int32(g: OnnxGraph) -> None:
    def dq_scale(t: str) -> np.ndarray | None:
        dq = g.producer(t)
        return g.const(dq.input[1]) if dq is not None and dq.op_type == "DequantizeLinear" else None

    for n in [n for n in g.nodes if n.op_type in ("Conv", "Gemm") and len(n.input) == 3]:
        b = g.const(n.input[2])
        sx, sw = dq_scale(n.input[0]), dq_scale(n.input[1])
        if b is None or sx is None or sw is None or sx.size != 1 or b.dtype != np.float32 or b.ndim != 1:
            continue
        if n.op_type == "Gemm" and (g.attr(n, "alpha", 1.0) != 1.0 or g.attr(n, "beta", 1.0) != 1.0):
            continue
        scale = (sx.astype(np.float32) * sw.astype(np.float32)).reshape(-1)
        q = np.rint(b / scale)
        if not np.all(np.abs(q) < 2**31 - 1):
            continue
        name = g.add_init(q.astype(np.int32), n.input[2] + "_int32")
        sname = g.add_init(scale if scale.size > 1 else scale.reshape(()), n.input[2] + "_scale")
        zname = g.add_init(np.zeros(scale.shape if scale.size > 1 else (), np.int32), n.input[2] + "_zp")
        dq = g.make("DequantizeLinear", [name, sname, zname], axis=0)
        g.set_input(n, 2, dq.output[0])


def _fuse_pads(g: OnnxGraph) -> int:
    """Pad -> Q -> DQ -> Conv(s), a constant-zero Pad on the spatial axes only: the Q moves
    before the Pad and the Conv takes the padding itself (QLinearConv pads with the zero point,
    i.e. with 0). Exact, since zero padding commutes with Q; quant_pre_process does the same
    fusion for quantize_static, and ORT fuses neither a Pad between Q/DQ nor one into QLinearConv."""
    fused = 0
    for pad in [n for n in g.nodes if n.op_type == "Pad"]:
        pads = g.const(pad.input[1]) if len(pad.input) > 1 else None
        users = g.users(pad.output[0])
        if pads is None or not passes(g, pad) or len(users) != 1 or users[0].op_type != "QuantizeLinear" \
                or g.is_output(pad.output[0]) or len(pad.input) > 3 and pad.input[3]:
            continue
        q = users[0]
        rank = pads.size // 2
        if rank < 3 or np.any(pads < 0) or np.any(pads[[0, 1, rank, rank + 1]] != 0):
            continue
        dqs = g.users(q.output[0])
        convs = [c for dq in dqs for c in g.users(dq.output[0])]
        if g.is_output(q.output[0]) or not dqs or any(dq.op_type != "DequantizeLinear" or g.is_output(dq.output[0])
                                                      for dq in dqs) or \
                any(c.op_type != "Conv" or c.input[0] not in [d.output[0] for d in dqs] or
                    g.attr(c, "auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID") for c in convs):
            continue
        src = pad.input[0]
        before = g.producer(src)
        if before is not None and before.op_type == "DequantizeLinear" and qparams(g, before) == qparams(g, q):
            new_in = src  # already DQ(Q(.)) with these qparams
        else:
            q2 = g.make("QuantizeLinear", [src, q.input[1], q.input[2]])
            new_in = g.make("DequantizeLinear", [q2.output[0], q.input[1], q.input[2]]).output[0]
        begin, end = pads[2:rank], pads[rank + 2:]
        for c in convs:
            old = list(g.attr(c, "pads", [0] * (2 * (rank - 2))))
            new = [int(a + b) for a, b in zip(old, [*begin, *end])]
            for a in [a for a in c.attribute if a.name in ("pads", "auto_pad")]:  # VALID: pads 0
                c.attribute.remove(a)
            c.attribute.append(onnx.helper.make_attribute("pads", new))
            g.set_input(c, 0, new_in)
        fused += 1
    return fused


def _add_bound(g: OnnxGraph, add) -> tuple[float, float] | None:
    """For an Add of two quantized tensors feeding (through a Relu) an average pool: the range
    its inputs' ranges bound (never clips), so ORT runs QLinearAdd + QLinearGlobalAveragePool."""
    users = g.users(add.output[0])
    if len(users) == 1 and users[0].op_type == "Relu":
        users = g.users(users[0].output[0])
    if len(users) != 1 or users[0].op_type not in ("GlobalAveragePool", "AveragePool"):
        return None
    lo = hi = 0.0
    for p in (qparams(g, g.producer(name)) for name in add.input):
        if p is None:
            return None
        lo, hi = lo + (np.iinfo(p[2]).min - p[1]) * p[0], hi + (np.iinfo(p[2]).max - p[1]) * p[0]
    return lo, hi


def _float_read(g: OnnxGraph, y: str, all_observers: bool) -> bool:
    """Whether an op other than an input quantizer or an integer average pool reads the conv
    output ``y`` (past the one Relu/Clip that ``qdq_place._fallback`` puts its Q/DQ behind). The
    observer's Q/DQ is a step fake-quant does not have: where only input quantizers read the
    tensor it costs at most one step of their grid (their own rounding follows), and a pool
    averages it (the last conv before the classifier keeps QLinearConv); a float reader (a
    BatchNormalization that timm's BatchNormAct2d leaves unfolded, a MaxPool into a residual
    Add, an Add, Concat or Mul, LayerNorm) computes on the observer's clipped, rounded values.
    Deploy vs fake-quant cosine with and without the step there (tests/zoo, random weights, ORT):
    timm DLA 0.80 vs 0.9998, DPN 0.92 vs 0.9996, HGNetV2 0.93 vs 1.0, FastViT 0.987 vs 0.99997,
    torchvision Inception-v3 (2:4) 0.957 vs 0.9999. Such a conv runs as a float kernel on its
    quantized input. With ``all_observers`` (``finish_deploy``) only an unfolded
    BatchNormalization reading ``y`` itself counts."""
    if all_observers:
        return any(u.op_type == "BatchNormalization" for u in g.users(y))
    users = g.users(y)
    if len(users) == 1 and users[0].op_type in ("Relu", "Clip") and not g.is_output(y):
        users = g.users(users[0].output[0])
    return any(u.op_type not in ("QuantizeLinear", *AVG_POOLS) or not _int8_pool(g, u) for u in users)


def _int8_pool(g: OnnxGraph, n) -> bool:
    """ORT's QLinearAveragePool averages a ceil_mode window that hangs over the input wrongly
    (HF EfficientNet's pooler, kernel 1280 on a 7x7 map: logits 12x too small): such pools stay
    float."""
    return n.op_type != "AveragePool" or not g.attr(n, "ceil_mode", 0)


def _qdq_chain(g: OnnxGraph, t: str, up: bool):
    """The op at the other end of a chain of per-tensor Q/DQ from ``t`` (upwards: its producer;
    downwards: its one user), each tensor on the way read once; None otherwise."""
    while True:
        users = [u for u in g.users(t) if t in u.input]  # (the index keeps readers set_input moved)
        if g.is_output(t) or len(users) != 1:
            return None
        n = g.producer(t) if up else users[0]
        if n is None or n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            return n
        s = g.const(n.input[1])
        if s is None or s.size != 1:
            return None
        t = n.input[0] if up else n.output[0]


def _flat_shuffles(g: OnnxGraph) -> int:
    """A channel shuffle, Reshape [N, groups, C/groups, H, W] -> Transpose (0, 2, 1, 3, 4) ->
    Reshape (ShuffleNetV2), gets H and W merged into one axis: the same bytes moved. On uint8,
    ORT's layout transformer pushes the NHWC layout of the QLinearConvs before it through the
    5-D Reshape and merges it with this Transpose into one 5-D permutation; torchvision
    ShuffleNetV2 at 224x224 ran 1.13x the time of the 4-D form (ORT 1.32, 2 threads)."""
    done = 0
    for t in [n for n in g.nodes if n.op_type == "Transpose"]:
        perm = list(g.attr(t, "perm", []))
        if len(perm) < 5 or perm[:3] != [0, 2, 1] or perm[3:] != list(range(3, len(perm))):
            continue
        before, after = _qdq_chain(g, t.input[0], up=True), _qdq_chain(g, t.output[0], up=False)
        shape = g.const(before.input[1]) if before is not None and before.op_type == "Reshape" else None
        if shape is None or after is None or after.op_type != "Reshape" or g.const(after.input[1]) is None \
                or shape.size != len(perm) or not np.all(shape > 0):
            continue
        flat = np.array([*shape[:3], int(np.prod(shape[3:]))], np.int64)
        g.set_input(before, 1, g.add_init(flat, before.input[1] + "_flat"))
        for a in [a for a in t.attribute if a.name == "perm"]:
            t.attribute.remove(a)
        t.attribute.append(onnx.helper.make_attribute("perm", [0, 2, 1, 3]))
        done += 1
    return done


def finish_deploy(model: onnx.ModelProto, observers: dict[str, tuple[float, float]],
                  all_observers: bool = False) -> onnx.ModelProto:
    """The ONNX post-pass (module docstring); edits and returns ``model``.

    ``all_observers``: the observer Q/DQ on a conv output that float ops read too, so ORT runs
    QLinearConv there at the cost of a rounding step the fake-quant model does not take, and a
    residual Add reads the rounded tensor its next layer reads (QLinearAdd), another. For
    single-op QAT modules (``nn/convert.py``), which train no output quantizers; the graph flow's
    activation_quant technique trains one for every conv output that only int8 ops read, so
    there the step would fall only where the fake-quant model computes in float."""
    g = OnnxGraph(model)
    g.constants_to_initializers()
    g.fold_constants()
    _bias_to_int32(g)
    requantized = drop_requantize(g)
    dedupe(g)
    placed = splits_onto_grid(g) + resizes_onto_grid(g)
    int8 = 0
    for n in g.topological():
        if n.op_type in INT_ANCHORS:
            w = n.input[1]
            dq = g.producer(w)
            if dq is not None and dq.op_type == "DequantizeLinear":
                int8 += 1
                w = dq.input[0]
            if g.producer(n.input[0]) is None or g.producer(n.input[0]).op_type != "DequantizeLinear":
                continue
            # Only QLinearConv needs an output Q to run in integers; QGemm can output float, and
            # an observer Q/DQ after it only costs time and accuracy (MLP: 0.94 vs 1.05 x qs).
            obs = observers.get(w) if n.op_type == "Conv" and not _float_read(g, n.output[0], all_observers) else None
            placed += place(g, n.output[0], obs, all_observers)
        elif n.op_type == "MatMul" and all((p := g.producer(i)) is not None and p.op_type == "DequantizeLinear"
                                           and g.const(p.input[0]) is None for i in n.input[:2]):
            # an activation x activation product (techniques/matmul_quant.py): QLinearMatMul where
            # only quantizers of one qparams read its output, else MatMulIntegerToFloat (Swin-T
            # window shapes, ORT 1.32: QLinearMatMul 0.97x MatMulIntegerToFloat + Q; with a DQ
            # after it 1.15-1.2x MatMulIntegerToFloat, so a float reader gets no Q/DQ here)
            placed += place(g, n.output[0], None, all_observers)
        elif n.op_type in ("Add", "Mul", "GlobalAveragePool", "AveragePool", "Concat") and _int8_pool(g, n) and all(
                (p := g.producer(i)) is not None and p.op_type == "DequantizeLinear"
                for i in (n.input if n.op_type == "Concat" else n.input[:2])):
            # QLinearAdd / QLinearMul / QLinearGlobalAveragePool / QLinearAveragePool once the
            # output is quantized (Mul: a SiLU or squeeze-excitation, see QuantizedActivation;
            # Concat: QLinearConcat, techniques/concat_sites.py)
            placed += place(g, n.output[0], _add_bound(g, n) if n.op_type == "Add" else None, all_observers)
    pads = _fuse_pads(g)
    shuffles = _flat_shuffles(g)
    g.finish()
    logger.debug("deploy post-pass: %d zero pads fused into convs, %d Q(DQ) pairs dropped, %d channel shuffles "
                 "flattened", pads, requantized, shuffles)
    logger.debug("deploy post-pass: %d int8 weights, %d quantized outputs", int8, placed)
    return model
