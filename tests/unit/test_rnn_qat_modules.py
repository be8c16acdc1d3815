"""LSTMQAT / GRUQAT: upstream's single-op module names with the graph flow's recurrent numerics,
from_float, refusals, and export (the one-call save and torch.onnx.export -> convert_qat_model)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.nn.module.quantization import GRUQAT, LSTMQAT, LinearQAT


class Head(nn.Module):
    def __init__(self, rnn: nn.Module, fc: nn.Module) -> None:
        super().__init__()
        self.rnn, self.fc = rnn, fc

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


def _cos(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _run(path, x):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]


def test_from_float_trains_like_the_graph_flow(tmp_path):
    """One LSTM, quantized either way, computes the same bits after the same batches."""
    torch.manual_seed(0)
    lstm = nn.LSTM(6, 10, num_layers=2, batch_first=True)
    x, x2 = torch.randn(3, 5, 6), torch.randn(3, 5, 6)
    cfg = str(tmp_path / "q.json")
    model = Head(lstm, nn.Identity())
    amct.create_quant_retrain_config(cfg, model, x)
    graph = amct.create_quant_retrain_model(cfg, model, str(tmp_path / "r.txt"), x)
    single = LSTMQAT.from_float(lstm)
    assert isinstance(single, nn.LSTM) and single.weight_ih_l0 is not lstm.weight_ih_l0
    graph.train()
    single.train()
    graph(x)
    single(x)
    graph.eval()
    single.eval()
    with torch.no_grad():
        assert torch.equal(graph(x2), single(x2)[0][:, -1])


def test_constructor_config_and_refusals():
    m = GRUQAT(4, 8, num_layers=2, bidirectional=True, config={"retrain_weight_config": {"channel_wise": False}})
    assert isinstance(m, nn.GRU) and m.wts_quant["weight_hh_l1_reverse"].channel_wise is False
    assert set(m.h_quant) == {"l0", "l0_reverse", "l1", "l1_reverse"}
    off = LSTMQAT(4, 8, config={"retrain_enable": False})
    x = torch.randn(5, 2, 4)
    torch.testing.assert_close(off(x)[0], nn.LSTM.forward(off, x)[0])
    with pytest.raises(ValueError, match="retrain_data_config: unknown key 'clipmax'"):
        LSTMQAT(4, 8, config={"retrain_data_config": {"clipmax": 1.0}})
    with pytest.raises(ValueError, match="proj_size"):
        LSTMQAT(4, 8, proj_size=2)
    with pytest.raises(TypeError, match="expects a torch.nn.LSTM, got GRU"):
        LSTMQAT.from_float(nn.GRU(4, 8))
    with pytest.raises(TypeError, match="already a quantized layer"):
        GRUQAT.from_float(m)


@pytest.mark.parametrize("path", ["one_call", "convert"])
def test_export(tmp_path, path):
    torch.manual_seed(0)
    model = Head(LSTMQAT(6, 12, batch_first=True, bidirectional=True), LinearQAT(24, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 7, 6)).square().mean().backward()
        opt.step()
    model.eval()
    x = torch.randn(4, 7, 6)
    prefix = str(tmp_path / "m")
    if path == "one_call":
        amct.save_quant_retrain_model("", model, "", prefix, x)
    else:
        inter = str(tmp_path / "inter.onnx")
        torch.onnx.export(model, (x,), inter, dynamo=False, opset_version=17)
        amct.convert_qat_model(inter, prefix)
    with torch.no_grad():
        want = model(x).numpy()
    fake, deploy = _run(prefix + "_fake_quant_model.onnx", x), _run(prefix + "_deploy_model.onnx", x)
    # both files leave the hidden state float (an ONNX LSTM has no step hook): not bit-exact
    assert _cos(fake, want) >= 0.999 and _cos(deploy, want) >= 0.999
    g = onnx.load(prefix + "_deploy_model.onnx").graph
    assert sum(n.op_type == "LSTM" for n in g.node) == 1
    int8 = {i.name for i in g.initializer if i.data_type == onnx.TensorProto.INT8}
    assert sum(n.op_type == "DequantizeLinear" and n.input[0] in int8 for n in g.node) >= 16  # 4 gates x 2 x 2
