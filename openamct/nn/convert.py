"""``convert_qat_model``: the fake-quant and deploy models of an ONNX exported from a model
holding single-op QAT modules, and ``save_qat_model``, the one-call path from the torch model.

The deploy model is the graph flow's layout (``export.deploy``), built on the same post-pass
(``finish_deploy``), so ONNX Runtime runs it with the same integer kernels (QLinearConv, QGemm,
QLinearAdd...). Before the post-pass, the intermediate file is brought to the form the graph
flow's folded model exports:

- each weight becomes an int8 initializer ``<weight>_int8`` (the fake-quantized weight's grid
  values) read through one DequantizeLinear (per output channel, or one scale), zero point 0;
- a BatchNormalization that is a Conv's (or ConvTranspose's) only reader is folded into it, as
  the graph flow folds it at create: per output channel c = gamma / sqrt(var + eps), the
  weight scales times |c| (grid values negated where c < 0), bias c * b + beta - c * mean;
- each int8 input pair becomes uint8 with zero point + 128 (the same grid); an INT16 input
  (float ops in the file) becomes ONNX Runtime's int16 QuantizeLinear/DequantizeLinear
  (``com.microsoft``; the CPU provider runs them, then the layer's float kernel: no int16
  Conv/Gemm exists there);
- each output-range pair is removed and its range handed to the post-pass as the layer's
  observer range (through a folded BN: the per-channel affine image of each channel's range).

Files are written atomically (``export.writer.write_onnx``) and carry one save id.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import Any

import numpy as np
import onnx
from torch import nn

from openamct._atomic import temp_prefix
from openamct._checks import check_type, save_paths
from openamct.export.deploy import finish_deploy
from openamct.export.element_types import numpy_dtype
from openamct.export.export_layer import inputs_on_cpu, working_copy
from openamct.export.ids import SAVE_ID_KEY, hash_model
from openamct.export.int4_onnx import finish_int4_deploy, native_int4
from openamct.export.writer import export_to_file, write_onnx
from openamct.formats import INT8_ACT, INT8_WEIGHT, unsigned
from openamct.nn.module.quantization.base import QATLayer
from openamct.nn.module.quantization.rnn_qat_base import RecurrentQAT
from openamct.nn.qat_onnx import (
    OnnxQatLayer,
    QatGraph,
    fake_weight,
    read_qat,
    skip_pair,
    write_fake_quant,
)
from openamct.output_paths import check_output, check_path_syntax

logger = logging.getLogger(__name__)

# The single-op modules' weight format: their exported Q/DQ pairs hold INT8 grids.
WEIGHT = INT8_WEIGHT

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops: int16 QuantizeLinear/DequantizeLinear on the CPU

__all__ = ["convert_qat_model", "save_qat_model", "holds_qat_modules"]


def _bn_fold(g, layer: OnnxQatLayer):
    """(c, d, bn node) when the layer's only reader is a BatchNormalization with constant
    parameters: y_bn = c * y + d per output channel."""
    n = layer.node
    if n.op_type not in ("Conv", "ConvTranspose") or g.is_output(n.output[0]):
        return None
    users = g.users(n.output[0])
    if len(users) != 1 or users[0].op_type != "BatchNormalization" or len(users[0].output) != 1:
        return None
    bn = users[0]
    gamma, beta, mean, var = (g.const(i) for i in bn.input[1:5])
    if any(v is None for v in (gamma, beta, mean, var)):
        return None
    eps = np.float32(g.attr(bn, "epsilon", 1e-5))
    c = (gamma.astype(np.float32) / np.sqrt(var.astype(np.float32) + eps)).astype(np.float32)
    return c, (beta.astype(np.float32) - c * mean.astype(np.float32)).astype(np.float32), bn


def _out_axis(layer: OnnxQatLayer) -> int:
    """The output-channel axis of the layer's weight (ConvTranspose: [Cin, Cout, ...], groups 1)."""
    return 1 if layer.node.op_type == "ConvTranspose" else 0


def _deploy_layer(g, layer: OnnxQatLayer, observers: dict) -> None:
    w = layer.weight
    wf = fake_weight(g, w)
    axis = _out_axis(layer)
    if w.axis is not None and w.axis % wf.ndim != axis:
        raise ValueError(f"weight {w.name!r}: quantized along axis {w.axis}, not its output channels")
    shape = [1] * wf.ndim
    shape[axis] = -1
    scales = w.scales.astype(np.float32)
    q = np.clip(np.rint(wf / (scales.reshape(shape) if w.axis is not None else scales[0])), WEIGHT.qmin, WEIGHT.qmax)
    rng = None  # (lows, highs) of the output, per channel where the marker has them
    if layer.marker is not None:
        m = layer.marker
        # A scale at the floor: an observer that never saw a batch (torch.export writes the pair
        # anyway, it cannot read the flag): no range.
        if m.scale > 2 * float(np.finfo(np.float32).eps):
            rng = m.ranges()
        skip_pair(g, m)
    fold = _bn_fold(g, layer)
    per_channel = w.axis is not None
    if fold is not None:
        c, d, bn = fold
        cout = wf.shape[axis]
        scales = (np.broadcast_to(scales, (cout,)) * np.abs(c)).astype(np.float32)
        q = q * np.where(c < 0, -1.0, 1.0).astype(np.float32).reshape(shape)
        q = np.clip(q, WEIGHT.qmin, WEIGHT.qmax)
        per_channel = True
        b = g.const(layer.node.input[2]) if len(layer.node.input) > 2 and layer.node.input[2] else None
        b = np.zeros(cout, np.float32) if b is None else b.astype(np.float32)
        bias = g.add_init((c * b + d).astype(np.float32), f"{w.name}_bias_bn_folded")
        if len(layer.node.input) > 2:
            g.set_input(layer.node, 2, bias)
        else:
            layer.node.input.append(bias)
            g._users[bias].append(layer.node)
        if rng is not None:  # the per-channel affine image of each channel's [lo, hi]
            rng = (c * rng[0] + d, c * rng[1] + d)
        g.replace_uses(bn.output[0], layer.node.output[0])
        g.remove(bn)
    stored = numpy_dtype(WEIGHT)
    qname = g.add_init(q.astype(stored), f"{w.name}_int8")
    sname = g.add_init(scales if per_channel else scales.reshape(()), f"{w.name}_scale")
    zname = g.add_init(np.zeros(scales.shape if per_channel else (), stored), f"{w.name}_zero_point")
    dq = g.make("DequantizeLinear", [qname, sname, zname], **({"axis": axis} if per_channel else {}))
    if layer.transpose is not None:
        g.set_input(layer.transpose, 0, dq.output[0])
    else:
        g.set_input(layer.node, 1, dq.output[0])
    if rng is not None and layer.act is not None and not layer.act.ops:
        ends = np.concatenate([np.ravel(rng[0]), np.ravel(rng[1])])
        observers[qname] = (float(ends.min()), float(ends.max()))  # (an INT16 layer runs a float kernel)


def write_deploy(qg: QatGraph) -> dict[str, tuple[float, float]]:
    """Bring ``qg``'s graph to the graph flow's folded form (module docstring); returns the
    observer ranges for ``finish_deploy``, keyed by int8 weight name."""
    g = qg.g
    observers: dict[str, tuple[float, float]] = {}
    for layer in qg.layers:
        _deploy_layer(g, layer, observers)
    for m in qg.markers:  # a marker after no QAT layer
        if g.producer(m.dq.output[0]) is not None:
            skip_pair(g, m)
    for a in qg.acts:
        if a.ops:  # INT16: ORT's int16 Q/DQ (contrib domain: the standard ops take int16 from opset 21)
            x = a.q.input[0] if g.const(a.q.input[1]) is not None else a.q.input[1]
            s = g.add_init(np.array(a.scale, np.float32), f"{x}_scale_i16")
            z = g.add_init(np.array(a.zero_point, np.int16), f"{x}_zero_point_i16")
            q = g.make("QuantizeLinear", [x, s, z], domain=MS_DOMAIN)
            dq = g.make("DequantizeLinear", [q.output[0], s, z], domain=MS_DOMAIN)
            g.replace_uses(a.dq.output[0], dq.output[0])
            for n in a.ops:
                g.remove(n)
            continue
        deploy, shift = unsigned(INT8_ACT)
        z = g.add_init(np.array(a.zero_point + shift, numpy_dtype(deploy)), f"{a.q.input[0]}_zero_point_u8")
        g.set_input(a.q, 2, z)
        g.set_input(a.dq, 2, z)
    g.finish()
    return observers


def _stamp(models) -> None:
    h = hashlib.sha256()
    for m in models:
        hash_model(h, m)
    for m in models:
        entry = m.metadata_props.add()
        entry.key, entry.value = SAVE_ID_KEY, h.hexdigest()[:32]


def _outputs(save_path: str, inputs: dict) -> tuple[str, str]:
    fake, deploy = save_paths(save_path)
    for path in (fake, deploy):
        check_output("save_path", path, "onnx", inputs, make_folder=True)
    os.makedirs(os.path.dirname(os.path.abspath(fake)), exist_ok=True)
    return fake, deploy


def _convert(model: onnx.ModelProto, fake_path: str, deploy_path: str, where: str) -> None:
    # Shapes and types the exporter recorded for intermediate tensors (torch.export writes them)
    # would contradict the rewritten graph (an int8 pair becomes uint8): ORT infers them again.
    del model.graph.value_info[:]
    fake = onnx.ModelProto()
    fake.CopyFrom(model)
    write_fake_quant(read_qat(fake, where))
    native_int4(fake, None, reproduce=True)  # an INT4 LSTM/GRU's gate blocks (int4_onnx.py)
    deploy = model  # the caller's copy: edited in place
    observers = write_deploy(read_qat(deploy, where))
    if any(n.domain == MS_DOMAIN for n in deploy.graph.node) and \
            not any(o.domain == MS_DOMAIN for o in deploy.opset_import):
        deploy.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    finish_deploy(deploy, observers, all_observers=True)  # single-op modules train no output quantizers
    # INT4 weights (A8W4 modules) as 4 bits. The file does not say which modules were INT4; a
    # weight whose grid values all lie in -8..7 is one (an INT8 ARQ weight reaches +-127).
    finish_int4_deploy(deploy, None)
    _stamp([fake, deploy])
    write_onnx(fake, fake_path)
    write_onnx(deploy, deploy_path)
    logger.info("wrote %s and %s", fake_path, deploy_path)


def convert_qat_model(model_file: str, save_path: str) -> None:
    """Read ``model_file`` (an ONNX exported with ``torch.onnx.export`` from a model holding
    single-op QAT modules) and write ``{save_path}_fake_quant_model.onnx`` and
    ``{save_path}_deploy_model.onnx``. ValueError when the file holds no QAT layer."""
    check_type("model_file", model_file, str)
    check_path_syntax("model_file", model_file)
    if not os.path.isfile(model_file):
        raise ValueError(f"model_file {model_file!r} does not exist or is not a file")
    check_type("save_path", save_path, str)
    fake_path, deploy_path = _outputs(save_path, {"model_file": model_file})
    try:
        model = onnx.load(model_file)
    except Exception as exc:  # onnx raises DecodeError, ValueError, OSError... for a file that is not ONNX
        raise ValueError(f"model_file {model_file!r} is not a readable ONNX model: {exc}") from None
    _convert(model, fake_path, deploy_path, f"model_file {model_file!r}")


def holds_qat_modules(model: nn.Module) -> bool:
    return any(isinstance(m, (QATLayer, RecurrentQAT)) and m.act_quant is not None for m in model.modules())


def save_qat_model(model: nn.Module, save_path: str, input_data: Any, input_names=None, output_names=None,
                   dynamic_axes=None) -> tuple[str, str]:
    """The one-call path: export ``model`` (holding QAT modules; left as it was) as
    ``convert_qat_model`` reads it, then convert, without an intermediate file of the caller's."""
    pending = [n for n, m in model.named_modules() if (isinstance(m, QATLayer) and m.act_quant is not None
               and not bool(m.act_quant.initialized))
               or (isinstance(m, RecurrentQAT) and m.act_quant is not None and m.quantizers_pending())]
    if pending:
        raise ValueError(f"the input quantizers of {len(pending)} QAT layer(s) ({', '.join(pending[:4])}) are not "
                         "initialised yet: run the model on real data first (clips are set from the first "
                         "batch_num forward passes)")
    fake_path, deploy_path = _outputs(save_path, {})
    folder = os.path.dirname(os.path.abspath(fake_path))
    work = working_copy(model, cpu=True).eval()
    with tempfile.TemporaryDirectory(prefix=temp_prefix("qat"), dir=folder) as tmp:
        path = export_to_file(work, inputs_on_cpu(input_data), tmp, input_names, output_names, dynamic_axes)
        del work
        model_proto = onnx.load(path, load_external_data=True)
    _convert(model_proto, fake_path, deploy_path, "model")
    return fake_path, deploy_path

