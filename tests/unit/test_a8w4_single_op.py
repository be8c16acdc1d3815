"""The single-op QAT modules under A8W4 (INT4 weights) and, for LSTM/GRU, A16W8: their config
takes the pair, they train with INT4 weights, and both export paths (the one-call save and
torch.onnx.export -> convert_qat_model) give files ONNX Runtime runs, the deploy one with its
INT4 weights stored as 4 bits."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.nn.module.quantization import (
    GRUQAT,
    LSTMQAT,
    Conv1dQAT,
    Conv2dQAT,
    ConvTranspose2dQAT,
    LinearQAT,
)
from tests.unit.test_rnn_qat_modules import Head

W4 = {"retrain_weight_config": {"dst_type": "INT4"}}
D16 = {"retrain_data_config": {"dst_type": "INT16"}}


def _trained(net, shape):
    torch.manual_seed(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(*shape)).square().mean().backward()
        opt.step()
    return net.eval()


def _run(path, x):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]


def _cos(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_config_takes_the_pairs():
    assert Conv2dQAT(3, 4, 3, config=W4).wts_quant.format.bits == 4
    lstm = LSTMQAT(4, 6, config={**W4})
    assert all(q.format.bits == 4 for q in lstm.wts_quant.values())  # weight_hh too: the format's bits
    gru = GRUQAT(4, 6, config=D16)
    assert all(q.format.bits == 16 for q in (*gru.x_quant.values(), *gru.h_quant.values()))
    with pytest.raises(ValueError, match=r"retrain_weight_config.dst_type: .*A16W4\) is refused"):
        LinearQAT(4, 6, config={**D16, **W4})
    with pytest.raises(ValueError, match="Int4 quantization aware training is not supported"):
        Conv1dQAT(3, 4, 3, config={"retrain_data_config": {"dst_type": "INT4"}})


def test_int4_weights_train_on_the_int4_grid():
    torch.manual_seed(0)
    m = LinearQAT(16, 8, config={"retrain_weight_config": {"dst_type": "INT4", "channel_wise": True}})
    w = m.wts_quant(m.weight).detach()
    ints = w / m.wts_quant.scales(m.weight).reshape(-1, 1)
    assert torch.allclose(ints, ints.round(), atol=1e-4) and ints.round().abs().max() <= 8
    assert max(len(torch.unique(r.round())) for r in ints) <= 16


CASES = {
    "conv_linear": (lambda: nn.Sequential(Conv2dQAT(3, 8, 3, config=W4), nn.ReLU(),
                                          ConvTranspose2dQAT(8, 4, 2, stride=2, config=W4), nn.Flatten(),
                                          LinearQAT(4 * 12 * 12, 5, config=W4)), (4, 3, 8, 8)),
    "lstm_a8w4": (lambda: Head(LSTMQAT(6, 12, batch_first=True, config=W4), LinearQAT(12, 3, config=W4)), (4, 7, 6)),
    "gru_a16w8": (lambda: Head(GRUQAT(6, 12, batch_first=True, config=D16), LinearQAT(12, 3)), (4, 7, 6)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["one_call", "convert"])
def test_export(tmp_path, case, path):
    make, shape = CASES[case]
    net = _trained(make(), shape)
    x = torch.randn(*shape)
    with torch.no_grad():
        want = net(x).numpy()
    prefix = str(tmp_path / "m")
    if path == "one_call":
        amct.save_quant_retrain_model("", net, "", prefix, x)
    else:
        torch.onnx.export(net, (x,), str(tmp_path / "i.onnx"), dynamo=False, opset_version=17)
        amct.convert_qat_model(str(tmp_path / "i.onnx"), prefix)
    fake, deploy = prefix + "_fake_quant_model.onnx", prefix + "_deploy_model.onnx"
    got_fake, got_deploy = _run(fake, x), _run(deploy, x)
    if case == "conv_linear":  # no recurrent hidden state left float: the same function
        np.testing.assert_allclose(got_fake, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        # (the deploy model rounds each conv output to its observed uint8 range: not bit-exact)
        assert _cos(got_deploy, want) >= 0.999
    else:
        assert _cos(got_fake, want) >= 0.999 and _cos(got_deploy, want) >= 0.999
    g = onnx.load(deploy).graph
    int4 = [t for t in g.initializer if t.data_type == onnx.TensorProto.INT4 and len(t.dims) >= 2]
    nbits = sum(n.op_type == "MatMulNBits" for n in g.node)
    if case == "conv_linear":
        assert nbits == 1 and len(int4) == 2
    elif case == "lstm_a8w4":
        assert nbits == 1 and len(int4) == 8  # 4 gate blocks of weight_ih and of weight_hh
        assert sum(t.data_type == onnx.TensorProto.INT4 and len(t.dims) >= 2
                   for t in onnx.load(fake).graph.initializer) == 8
    else:
        assert nbits == 0 and not int4
        assert sorted(n.op_type for n in g.node if n.domain == "com.microsoft") == ["DequantizeLinear", "QuantizeLinear"]
