"""A second weight format needs only its table entry and its export mapping: INT4 weight-only
fake-quant through create -> training -> restore -> save, with activations staying INT8."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from google.protobuf import text_format

import openamct as amct
from openamct import pipeline
from openamct.compressed.layer import CompressedLayer
from openamct.export.element_types import onnx_element_type
from openamct.formats import INT4_WEIGHT, INT8_ACT, INT8_WEIGHT, activation_format, weight_format
from openamct.large.fused_linear import eval_linear, masked_quant_linear
from openamct.quant.quantizers import WeightARQ
from openamct.record.file_io import read_record
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.record.values import check_record_values
from tests.models import MODELS, Net001, example_input
from tests.numerics import assert_same_quantized_function
from tests.training import sgd_steps


def test_format_table():
    assert (INT8_ACT.qmin, INT8_ACT.qmax, INT8_ACT.levels) == (-128, 127, 255)
    assert not INT8_ACT.symmetric and not INT8_ACT.per_channel
    assert (INT8_WEIGHT.qmin, INT8_WEIGHT.qmax) == (-128, 127) and INT8_WEIGHT.symmetric
    assert (INT4_WEIGHT.qmin, INT4_WEIGHT.qmax, INT4_WEIGHT.levels) == (-8, 7, 15)
    assert weight_format("INT4", channel_wise=True) == INT4_WEIGHT
    assert weight_format("INT8", channel_wise=False).per_channel is False
    assert activation_format("INT8") == INT8_ACT
    with pytest.raises(ValueError, match="INT4.*activations"):
        activation_format("INT4")
    with pytest.raises(ValueError, match="INT16"):
        weight_format("INT16", channel_wise=True)
    assert onnx_element_type(INT8_WEIGHT) == onnx.TensorProto.INT8
    assert onnx_element_type(INT4_WEIGHT) == onnx.TensorProto.INT4


def test_int4_activations_refused_with_the_field(tmp_path):
    p = tmp_path / "a.cfg"
    p.write_text("retrain_data_quant_config { ulq_quantize { dst_type: INT4 } }\n")
    with pytest.raises(ValueError, match=r"line 1:\d+.*ulq_quantize.dst_type: INT4 .*weights only"):
        pipeline.analyse(Net001(), torch.randn(1, 2, 28, 28), str(p), "compressed")


def test_int4_weights_planned(tmp_path):
    p = tmp_path / "w.cfg"
    p.write_text("retrain_weight_quant_config { arq_retrain { dst_type: INT4 } }\n")
    plan = pipeline.analyse(Net001(), torch.randn(1, 2, 28, 28), str(p), "compressed").plan
    specs = [lp.quant for lp in plan.layers.values() if lp.quant is not None]
    assert specs and all(s.wts.format.name == "INT4" and s.act.format == INT8_ACT for s in specs)


def test_record_offsets_checked_against_the_recorded_format():
    rec = ScaleOffsetRecord()
    v = rec.record.add(key="conv").value
    v.scale_d, v.offset_d = 0.1, -128
    v.scale_w.append(0.5)
    v.offset_w.append(0)
    v.wts_type = "INT4"
    check_record_values(rec, "r")
    v.wts_type = "INT3"
    with pytest.raises(ValueError, match=r"record\[0\].*wts_type is 'INT3'"):
        check_record_values(rec, "r")
    v.wts_type = "INT4"
    v.act_type = "INT4"
    with pytest.raises(ValueError, match="act_type is 'INT4'"):
        check_record_values(rec, "r")


@pytest.mark.parametrize("channel_wise", [True, False])
def test_fused_linear_takes_the_int4_range(channel_wise):
    """The large-model Linear step computes what the composed INT4 ARQ path does."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g).requires_grad_()
    x = torch.randn(6, 40, generator=g)
    q = WeightARQ(channel_wise=channel_wise, fmt=INT4_WEIGHT)
    ref = torch.nn.functional.linear(x, q(w))
    y, scales = masked_quant_linear(x, w, None, None, channel_wise, False, qmax=INT4_WEIGHT.qmax)
    torch.testing.assert_close(scales, q.scales(w))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    assert torch.isfinite(w.grad).all()
    ye, _ = eval_linear(x, w, None, channel_wise, False, qmax=INT4_WEIGHT.qmax)
    torch.testing.assert_close(ye, ref.detach(), rtol=1e-5, atol=1e-5)
    ints = (q(w.detach()) / q.scales(w).reshape(-1, 1)).round()
    assert ints.abs().max() <= 7 and all(len(torch.unique(r)) <= 15 for r in ints)


def _cfg(tmp_path, algo: str) -> str:
    p = tmp_path / "int4.cfg"
    p.write_text("retrain_data_quant_config { ulq_quantize { } }\n"
                 f"retrain_weight_quant_config {{ {algo} {{ dst_type: INT4 }} }}\n")
    return str(p)


@pytest.mark.parametrize("algo", ["arq_retrain", "ulq_retrain"])
def test_int4_weight_lifecycle(tmp_path, algo):
    name = "ResBlockNet"
    x = example_input(name)
    cfg, rec, ckpt = _cfg(tmp_path, algo), str(tmp_path / "record.txt"), str(tmp_path / "m.pth")
    torch.manual_seed(0)
    c = amct.create_compressed_retrain_model(MODELS[name](), x, cfg, rec)
    layers = {n: m for n, m in c.named_modules() if isinstance(m, CompressedLayer)}
    assert layers and all(m.wts_quant.format.name == "INT4" for m in layers.values())
    assert all(m.act_quant.format == INT8_ACT for m in layers.values())
    g = torch.Generator().manual_seed(1)
    sgd_steps(c, lambda m: m(torch.randn((8, *x.shape[1:]), generator=g)), steps=3, lr=0.01)
    c.eval()
    with torch.no_grad():
        ref_out = c(x)
    torch.save({"state_dict": c.state_dict()}, ckpt)

    record = read_record(rec)
    assert len(record.record) == len(layers)
    for e in record.record:
        assert e.value.wts_type == "INT4" and not e.value.HasField("act_type"), e.key
    assert 'wts_type: "INT4"' in open(rec).read()

    int8_cfg = tmp_path / "int8.cfg"
    int8_cfg.write_text(open(cfg).read().replace(" dst_type: INT4 ", " "))
    with pytest.raises(ValueError, match="quantized with wts_type INT4, but the config asks for INT8"):
        amct.restore_compressed_retrain_model(MODELS[name](), x, str(int8_cfg), rec, ckpt, "state_dict")
    r = amct.restore_compressed_retrain_model(MODELS[name](), x, cfg, rec, ckpt, "state_dict")
    r.eval()
    with torch.no_grad():
        assert torch.equal(r(x), ref_out)

    amct.save_compressed_retrain_model(r, rec, str(tmp_path / "out"), x, input_names=["x"])
    fake = onnx.load(str(tmp_path / "out_fake_quant_model.onnx"))
    # INT4 weights are native ONNX INT4 initializers read by opset-21 DequantizeLinear, per
    # output channel, with the record's scales
    inits = {t.name: t for t in fake.graph.initializer}
    scales = {e.key: np.asarray(e.value.scale_w, np.float32) for e in read_record(rec).record}
    assert any(o.domain == "" and o.version == 21 for o in fake.opset_import)
    checked = 0
    for node in fake.graph.node:
        w = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if w is None:
            continue
        assert w.data_type == onnx.TensorProto.INT4, w.name
        lname = w.name.removesuffix(".weight_int8")
        q = onnx.numpy_helper.to_array(w)
        assert q.min() >= -8 and q.max() <= 7, lname
        np.testing.assert_allclose(onnx.numpy_helper.to_array(inits[node.input[1]]).reshape(-1), scales[lname],
                                   rtol=1e-6)
        checked += 1
    assert checked == len(layers)
    sess = ort.InferenceSession(str(tmp_path / "out_fake_quant_model.onnx"), providers=["CPUExecutionProvider"])
    inputs = [example_input(name, seed=s) for s in range(8)]
    with torch.no_grad():
        ref = np.concatenate([r(i).numpy() for i in inputs])
    y = np.concatenate([sess.run(None, {"x": i.numpy()})[0] for i in inputs])
    assert_same_quantized_function(ref, y, what=f"{name} INT4 weights")

    # The deploy file stores the INT4 weights as 4-bit values: MatMulNBits for the Linears
    # (packed uint8), INT4 DequantizeLinear initializers for the convolutions; no int8 weight left.
    deploy = onnx.load(str(tmp_path / "out_deploy_model.onnx"))
    ops = [n.op_type for n in deploy.graph.node]
    int4 = [t for t in deploy.graph.initializer if t.data_type == onnx.TensorProto.INT4 and t.name.endswith("weight_int8")]
    linears = sum(m.kind == "linear" for m in layers.values())
    assert linears and ops.count("MatMulNBits") == linears and len(int4) == len(layers) - linears
    assert not [t for t in deploy.graph.initializer if t.data_type == onnx.TensorProto.INT8
                and t.name.endswith("weight_int8")]


def test_int8_record_text_has_no_type_fields(tmp_path):
    """INT8 is the proto default: its record names no type (bytes as before)."""
    name = "ResBlockNet"
    x = example_input(name)
    p = tmp_path / "q.cfg"
    p.write_text("retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n")
    rec = str(tmp_path / "r.txt")
    c = amct.create_compressed_retrain_model(MODELS[name](), x, str(p), rec)
    c.eval()
    with torch.no_grad():
        c(x)
    amct.save_compressed_retrain_model(c, rec, str(tmp_path / "o"), x)
    text = open(rec).read()
    assert "wts_type" not in text and "act_type" not in text
    assert text_format.Parse(text, ScaleOffsetRecord()).record[0].value.wts_type == "INT8"
