"""convert_qat_model and the one-call save: the fake-quant model reproduces the trained QAT
model, the deploy model is the graph flow's layout (integer kernels in ORT), bad input refused."""

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.nn.module.quantization import Conv2dQAT, Conv3dQAT, LinearQAT
from tests.runtimes import openvino_compile
from tests.training import sgd_steps

DATA = {"fixed_min": True}


class Net(nn.Module):
    """conv-BN-ReLU, a residual block and a Linear head: BN folding, output ranges, QLinearAdd."""

    def __init__(self, qat: bool) -> None:
        super().__init__()
        conv = (lambda *a, cfg=None, **k: Conv2dQAT(*a, **k, config=cfg)) if qat else \
            (lambda *a, cfg=None, **k: nn.Conv2d(*a, **k))
        self.c1, self.b1 = conv(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = conv(8, 8, 3, padding=1, cfg={"retrain_data_config": DATA}), nn.BatchNorm2d(8)
        # two ReLU modules: the graph flow quantizes the block input where a module called once
        # returns it (docs/limits.md)
        self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()
        self.fc = LinearQAT(8, 5, config={"retrain_data_config": DATA}) if qat else nn.Linear(8, 5)

    def forward(self, x):
        y = self.relu1(self.b1(self.c1(x)))
        y = self.relu2(self.b2(self.c2(y)) + y)
        return self.fc(y.mean((2, 3)))


def _train(model, steps=3):
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), 0.02)
    for _ in range(steps):
        loss = model(torch.randn(16, 3, 12, 12)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _run(path, x):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]


def _kernels(path, tmp_path):
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return sorted(n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node)


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    return _train(Net(qat=True))


def test_convert_fake_quant_reproduces_torch_and_deploy_is_integer(trained, tmp_path):
    x = torch.randn(8, 3, 12, 12)
    ref = trained(x).detach().numpy()
    torch.onnx.export(trained, (x,), str(tmp_path / "qat.onnx"), dynamo=False)
    amct.convert_qat_model(str(tmp_path / "qat.onnx"), str(tmp_path / "out"))
    fake, deploy = str(tmp_path / "out_fake_quant_model.onnx"), str(tmp_path / "out_deploy_model.onnx")
    assert np.abs(_run(fake, x) - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(_run(deploy, x) - ref).max() <= 0.05 * np.abs(ref).max()
    ov = openvino_compile(deploy, 1)
    assert np.abs(ov(x.numpy())[0] - ref).max() <= 0.05 * np.abs(ref).max()  # OpenVINO runs it too
    ops = [n.op_type for n in onnx.load(fake).graph.node]
    assert "QuantizeLinear" not in ops and ops.count("Round") == 3  # three input quantizers, as float ops
    kernels = _kernels(deploy, tmp_path)
    assert kernels.count("QLinearConv") == 2 and "BatchNormalization" not in kernels
    assert "QGemm" in kernels or "QLinearMatMul" in kernels, kernels
    meta = {p.key: p.value for p in onnx.load(deploy).metadata_props}
    assert meta == {p.key: p.value for p in onnx.load(fake).metadata_props} and meta
    # the one-call path writes the same models
    amct.save_quant_retrain_model("unused.json", trained, "unused.txt", str(tmp_path / "one"), (x,))
    assert np.array_equal(_run(str(tmp_path / "one_deploy_model.onnx"), x), _run(deploy, x))
    assert np.array_equal(_run(str(tmp_path / "one_fake_quant_model.onnx"), x), _run(fake, x))


def test_deploy_has_the_graph_flows_layout(trained, tmp_path):
    """The same network through create_quant_retrain_model: the same integer kernels."""
    x = torch.randn(8, 3, 12, 12)
    torch.onnx.export(trained, (x,), str(tmp_path / "qat.onnx"), dynamo=False)
    amct.convert_qat_model(str(tmp_path / "qat.onnx"), str(tmp_path / "single"))
    layer = {"retrain_enable": True, "retrain_data_config": {"fixed_min": False}}
    cfg = {"batch_num": 1, "c1": layer, "c2": {"retrain_enable": True, "retrain_data_config": DATA},
           "fc": {"retrain_enable": True, "retrain_data_config": DATA}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    graph = amct.create_quant_retrain_model(str(tmp_path / "c.json"), Net(qat=False), str(tmp_path / "r.txt"), (x,))
    _train(graph)
    amct.save_quant_retrain_model(str(tmp_path / "c.json"), graph, str(tmp_path / "r.txt"), str(tmp_path / "graph"),
                                  (x,))
    single = _kernels(str(tmp_path / "single_deploy_model.onnx"), tmp_path)
    assert single == _kernels(str(tmp_path / "graph_deploy_model.onnx"), tmp_path)


def test_refusals(tmp_path):
    with pytest.raises(TypeError, match="model_file"):
        amct.convert_qat_model(3, str(tmp_path / "o"))
    with pytest.raises(ValueError, match="does not exist"):
        amct.convert_qat_model(str(tmp_path / "missing.onnx"), str(tmp_path / "o"))
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a readable ONNX model"):
        amct.convert_qat_model(str(tmp_path / "junk.onnx"), str(tmp_path / "o"))
    torch.onnx.export(nn.Sequential(nn.Conv2d(3, 4, 3)), (torch.randn(1, 3, 8, 8),), str(tmp_path / "f.onnx"),
                      dynamo=False)
    with pytest.raises(ValueError, match="no QAT layer found"):
        amct.convert_qat_model(str(tmp_path / "f.onnx"), str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o_deploy_model.onnx")
    fresh = nn.Sequential(Conv2dQAT(3, 4, 3))
    with pytest.raises(ValueError, match="not initialised"):
        amct.save_quant_retrain_model("c.json", fresh, "r.txt", str(tmp_path / "p"), (torch.randn(1, 3, 8, 8),))


@pytest.mark.slow
def test_dynamo_export_converts_the_same(trained, tmp_path):
    x = torch.randn(8, 3, 12, 12)
    torch.onnx.export(trained, (x,), str(tmp_path / "ts.onnx"), dynamo=False)
    torch.onnx.export(trained, (x,), str(tmp_path / "dy.onnx"), dynamo=True)
    for name in ("ts", "dy"):
        amct.convert_qat_model(str(tmp_path / f"{name}.onnx"), str(tmp_path / name))
    for kind in ("fake_quant", "deploy"):
        a, b = (_run(str(tmp_path / f"{n}_{kind}_model.onnx"), x) for n in ("ts", "dy"))
        assert np.array_equal(a, b), kind


def test_conv3d_single_op_deploys_as_qlinearconv(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(Conv3dQAT.from_float(nn.Conv3d(3, 8, 3, padding=1)), nn.BatchNorm3d(8), nn.ReLU(),
                        Conv3dQAT(8, 8, (1, 3, 3), padding=(0, 1, 1), config={"retrain_data_config": DATA}),
                        nn.ReLU(), Conv3dQAT(8, 4, 1, config={"retrain_data_config": DATA}))
    x = torch.randn(2, 3, 4, 8, 8)
    sgd_steps(net, x, steps=2, lr=0.01)
    net.eval()
    amct.save_quant_retrain_model("c.json", net, "r.txt", str(tmp_path / "v"), (x,))
    ref = net(x).detach().numpy()
    assert np.abs(_run(str(tmp_path / "v_fake_quant_model.onnx"), x) - ref).max() <= 1e-5 * np.abs(ref).max()
    assert _kernels(str(tmp_path / "v_deploy_model.onnx"), tmp_path).count("QLinearConv") == 3


def test_int16_inputs_deploy_as_ort_int16_qdq(tmp_path):
    torch.manual_seed(0)
    cfg16 = {"retrain_data_config": {"dst_type": "INT16"}}
    net = nn.Sequential(Conv2dQAT(3, 8, 3, config=cfg16), nn.BatchNorm2d(8), nn.ReLU(),
                        Conv2dQAT(8, 8, 3, config={"retrain_data_config": DATA}), nn.ReLU(), nn.Flatten(),
                        LinearQAT(8 * 16, 5, config=cfg16))
    assert net[0].act_quant.format.name == "INT16" and net[0].act_quant.format.qmax == 32767
    x = torch.randn(8, 3, 8, 8)
    sgd_steps(net, x, steps=2, lr=0.01)
    net.eval()
    ref = net(x).detach().numpy()
    torch.onnx.export(net, (x,), str(tmp_path / "q.onnx"), dynamo=False)
    amct.convert_qat_model(str(tmp_path / "q.onnx"), str(tmp_path / "o"))
    assert np.abs(_run(str(tmp_path / "o_fake_quant_model.onnx"), x) - ref).max() <= 1e-5 * np.abs(ref).max()
    deploy = str(tmp_path / "o_deploy_model.onnx")
    assert np.abs(_run(deploy, x) - ref).max() <= 0.03 * np.abs(ref).max()
    wide = [n for n in onnx.load(deploy).graph.node if n.domain == "com.microsoft"]
    assert sorted(n.op_type for n in wide) == ["DequantizeLinear"] * 2 + ["QuantizeLinear"] * 2
    assert "QLinearConv" in _kernels(deploy, tmp_path)  # the INT8 conv still runs in integers


def test_the_range_of_a_conv_output_through_its_folded_bn_is_bounded_per_channel(trained, tmp_path):
    """c2's output reaches the residual Add through b2, which the deploy model folds: the
    QLinearConv output range is b2's affine image of each channel's observed range. The
    per-tensor range on every channel bounded it loosely (torchvision ResNet-18: 1.3 to 2.5
    times wider), a coarser grid that only the deploy model rounds to."""
    import copy

    from openamct.nn.convert import write_deploy
    from openamct.nn.qat_onnx import read_qat

    net = copy.deepcopy(trained)
    obs, bn = net.c2.out_observer, net.b2
    with torch.no_grad():  # every channel scaled to one width after the BN, the narrow ones most
        width = obs.max_val.clamp(min=0) - obs.min_val.clamp(max=0)
        bn.weight.copy_((bn.running_var + bn.eps).sqrt() / width * torch.tensor([1.0, -1.0] * 4))
    assert float(width.max() / width.min()) > 1.2
    torch.onnx.export(net, (torch.randn(2, 3, 12, 12),), str(tmp_path / "q.onnx"), dynamo=False)
    observers = write_deploy(read_qat(onnx.load(str(tmp_path / "q.onnx"))))
    lo, hi = obs.min_val.clamp(max=0).double(), obs.max_val.clamp(min=0).double()
    c = (bn.weight / (bn.running_var + bn.eps).sqrt()).detach().double()
    d = bn.bias.detach().double() - c * bn.running_mean.double()
    ends = torch.cat([c * lo + d, c * hi + d])
    got = next(v for k, v in observers.items() if k.startswith("c2."))
    s = (float(ends.max()) - float(ends.min())) / 255  # the range the marker's uint8 grid holds, to a step
    assert abs(got[0] - float(ends.min())) <= s and abs(got[1] - float(ends.max())) <= s
    loose = torch.cat([c * lo.min() + d, c * hi.max() + d])
    assert float(loose.max() - loose.min()) > 1.1 * (got[1] - got[0])
