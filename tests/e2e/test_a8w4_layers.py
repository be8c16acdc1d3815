"""A8W4 (INT8 activations, INT4 weights) on each of upstream's seven layer types, and A16W8 on
LSTM/GRU, through the graph flow: create -> a few training steps -> restore (the same outputs,
bit for bit) -> save -> ONNX Runtime and OpenVINO run both files. The fake-quant file holds its INT4 weights
as native ONNX INT4 initializers (opset 21) and computes what torch computes; the deploy file
stores them as 4 bits (MatMulNBits for a Linear, INT4 DequantizeLinear elsewhere)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.record.file_io import read_record
from tests.runtimes import openvino_compile

LAYERS = {
    "Conv1d": (lambda: nn.Conv1d(4, 8, 3, padding=1), (2, 4, 10)),
    "Conv2d": (lambda: nn.Conv2d(4, 8, 3, padding=1), (2, 4, 8, 8)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(4, 8, 3, stride=2), (2, 4, 10)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(4, 8, 3, stride=2), (2, 4, 6, 6)),
    "Linear": (lambda: nn.Linear(12, 16), (2, 5, 12)),
    "LSTM": (lambda: nn.LSTM(4, 8, batch_first=True, bidirectional=True), (2, 5, 4)),
    "GRU": (lambda: nn.GRU(4, 8, num_layers=2, batch_first=True), (2, 5, 4)),
}


class One(nn.Module):
    """The layer under test between two float ops (its input is not a graph input)."""

    def __init__(self, kind: str):
        super().__init__()
        self.layer = LAYERS[kind][0]()

    def forward(self, x):
        y = self.layer(torch.tanh(x))
        return (y[0] if isinstance(y, tuple) else y) * 2.0


def _cfg(tmp_path, act: str, wts: str) -> str:
    p = tmp_path / "q.cfg"
    p.write_text(f"retrain_data_quant_config {{ ulq_quantize {{ dst_type: {act} }} }}\n"
                 f"retrain_weight_quant_config {{ arq_retrain {{ dst_type: {wts} }} }}\n")
    return str(p)


def _lifecycle(tmp_path, kind: str, act: str, wts: str):
    shape = LAYERS[kind][1]
    torch.manual_seed(0)
    x = torch.randn(*shape)
    cfg, rec, ckpt = _cfg(tmp_path, act, wts), str(tmp_path / "r.txt"), str(tmp_path / "m.pth")
    m = amct.create_compressed_retrain_model(One(kind), x, cfg, rec)
    opt = torch.optim.SGD(m.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(*shape, generator=g)).square().mean().backward()
        opt.step()
    m.eval()
    with torch.no_grad():
        want = m(x)
    torch.save(m.state_dict(), ckpt)
    r = amct.restore_compressed_retrain_model(One(kind), x, cfg, rec, ckpt)
    r.eval()
    with torch.no_grad():
        assert torch.equal(r(x), want)
    amct.save_compressed_retrain_model(r, rec, str(tmp_path / "out"), x)
    return r, x, want.numpy(), read_record(rec)


def _run(path, x):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]


def _openvino(path, x):
    pytest.importorskip("openvino")
    c = openvino_compile(path, 2)
    return c.create_infer_request().infer({c.inputs[0].get_any_name(): x.numpy()})[c.outputs[0]]


def _cos(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("kind", list(LAYERS))
def test_a8w4(tmp_path, kind):
    r, x, want, record = _lifecycle(tmp_path, kind, "INT8", "INT4")
    assert record.record and all(e.value.wts_type == "INT4" and not e.value.HasField("act_type")
                                 for e in record.record)
    fake_path, deploy_path = str(tmp_path / "out_fake_quant_model.onnx"), str(tmp_path / "out_deploy_model.onnx")
    fake = onnx.load(fake_path)
    assert any(o.domain == "" and o.version == 21 for o in fake.opset_import)
    int4 = [t for t in fake.graph.initializer if t.data_type == onnx.TensorProto.INT4 and t.name.endswith("_int8")]
    recurrent = kind in ("LSTM", "GRU")
    assert len(int4) == (2 * len(r.layer.suffixes) if recurrent else 1)  # weight_ih and weight_hh per cell
    assert all(onnx.numpy_helper.to_array(t).min() >= -8 and onnx.numpy_helper.to_array(t).max() <= 7 for t in int4)
    assert not [t for t in fake.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 2
                and np.prod(t.dims) >= 32]  # no float copy of a weight
    np.testing.assert_allclose(_run(fake_path, x), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(_openvino(fake_path, x), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

    deploy = onnx.load(deploy_path)
    ops = [n.op_type for n in deploy.graph.node]
    int4 = [t for t in deploy.graph.initializer if t.data_type == onnx.TensorProto.INT4 and t.name.endswith("_int8")]
    if kind == "Linear":
        assert ops.count("MatMulNBits") == 1 and not int4
    else:
        gates = {"LSTM": 4, "GRU": 3}.get(kind, 1)
        assert len(int4) == gates * (2 * len(r.layer.suffixes) if recurrent else 1)
    assert not [t for t in deploy.graph.initializer if t.data_type == onnx.TensorProto.INT8 and "weight" in t.name]
    got = _run(deploy_path, x)
    if recurrent:  # the deploy LSTM/GRU keeps its hidden state float
        assert _cos(got, want) >= 0.999
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-3 * np.abs(want).max())
    np.testing.assert_allclose(_openvino(deploy_path, x), got, rtol=1e-3, atol=2e-3 * np.abs(got).max())


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a16w8(tmp_path, kind):
    r, x, want, record = _lifecycle(tmp_path, kind, "INT16", "INT8")
    assert all(q.format.bits == 16 for q in (*r.layer.x_quant.values(), *r.layer.h_quant.values()))
    assert record.record and all(e.value.act_type == "INT16" and not e.value.HasField("wts_type")
                                 for e in record.record)
    np.testing.assert_allclose(_run(str(tmp_path / "out_fake_quant_model.onnx"), x), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())
    deploy_path = str(tmp_path / "out_deploy_model.onnx")
    wide = [n for n in onnx.load(deploy_path).graph.node if n.domain == "com.microsoft"]
    layers = r.layer.num_layers
    assert sorted(n.op_type for n in wide) == ["DequantizeLinear"] * layers + ["QuantizeLinear"] * layers
    assert _cos(_run(deploy_path, x), want) >= 0.999


def test_per_layer_int4_leaves_the_int8_layers_int8(tmp_path):
    """One conv A8W4 by override, the rest A8W8: only that weight is 4-bit in either file, and
    the INT8 convs still run as ORT's QLinearConv."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4))
    x = torch.randn(4, 3, 6, 6)
    cfg = tmp_path / "q.cfg"
    cfg.write_text("retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
                   'override_layer_configs { layer_name: "2" retrain_data_quant_config { ulq_quantize { } } '
                   "retrain_weight_quant_config { arq_retrain { dst_type: INT4 } } }\n")
    m = amct.create_compressed_retrain_model(model, x, str(cfg), str(tmp_path / "r.txt"))
    m.train()
    m(x)
    m.eval()
    with torch.no_grad():
        want = m(x).numpy()
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "o"), x)
    for f in ("fake_quant", "deploy"):
        g = onnx.load(str(tmp_path / f"o_{f}_model.onnx")).graph
        assert [t.name for t in g.initializer if t.data_type == onnx.TensorProto.INT4 and len(t.dims) > 1] == \
            ["2.weight_int8"]
    deploy = str(tmp_path / "o_deploy_model.onnx")
    assert sorted(t.name for t in onnx.load(deploy).graph.initializer if t.data_type == onnx.TensorProto.INT8
                  and t.name.endswith("weight_int8")) == ["0.weight_int8", "4.weight_int8", "7.weight_int8"]
    from tests.runtimes import ort_optimized_ops

    assert ort_optimized_ops(deploy, tmp_path).count("QLinearConv") >= 1
    assert _cos(_run(deploy, x), want) >= 0.999
