"""Upstream's single-op QAT pages: Conv2dQAT.md, Conv3dQAT.md, ConvTranspose2dQAT.md,
LinearQAT.md, and docs/README.md's 单算子模式的量化感知训练 flows (training from scratch and
fine-tune). Upstream's convert_qat_model is ``amct_onnx.convert_model.convert_qat_model``, another
package: openamct's is ``openamct.convert_qat_model``, so that import line changes too."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from openamct import convert_qat_model  # was: from amct_onnx.convert_model import convert_qat_model
from openamct.nn.module.quantization.conv2d import Conv2dQAT
from openamct.nn.module.quantization.conv3d import Conv3dQAT
from openamct.nn.module.quantization.conv_transpose_2d import ConvTranspose2dQAT
from openamct.nn.module.quantization.gru import GRUQAT
from openamct.nn.module.quantization.linear import LinearQAT
from openamct.nn.module.quantization.lstm import LSTMQAT
from tests.upstream.pages import close, onnx_run


@pytest.mark.parametrize("cls, torch_cls", [(Conv2dQAT, torch.nn.Conv2d), (Conv3dQAT, torch.nn.Conv3d),
                                            (ConvTranspose2dQAT, torch.nn.ConvTranspose2d)])
def test_conv_pages(cls, torch_cls):
    """直接构造 and 基于原生算子构造, as each page writes them (keyword arguments)."""
    qat = cls(in_channels=1, out_channels=1, kernel_size=1, stride=1,
              padding=0, dilation=1, groups=1, bias=True,
              padding_mode='zeros', device=None, dtype=None, config=None)
    assert isinstance(qat, torch_cls) and qat.act_quant is not None
    op = torch_cls(in_channels=1, out_channels=1, kernel_size=1, stride=1,
                   padding=0, dilation=1, groups=1, bias=True,
                   padding_mode='zeros', device=None, dtype=None)
    qat = cls.from_float(mod=op, config=None)
    assert torch.equal(qat.weight, op.weight) and qat.weight is not op.weight


def test_linear_page():
    qat = LinearQAT(in_features=1, out_features=1, bias=True,
                    device=None, dtype=None, config=None)
    assert qat.act_quant is not None
    linear_op = torch.nn.Linear(in_features=1, out_features=1, bias=True, device=None, dtype=None)
    qat = LinearQAT.from_float(mod=linear_op, config=None)
    assert torch.equal(qat.weight, linear_op.weight)


def test_conv_transpose_takes_upstreams_positional_order():
    """Upstream's prototype: (in, out, kernel, stride, padding, dilation, groups, bias,
    padding_mode, device, dtype, config); torch's puts output_padding fifth."""
    qat = ConvTranspose2dQAT(4, 4, 3, 2, 1, 2)
    assert qat.dilation == (2, 2) and qat.output_padding == (0, 0)
    qat = ConvTranspose2dQAT(4, 6, 3, 2, 1, 3, 1, False, 'zeros', None, None, None)
    assert qat.dilation == (3, 3) and qat.groups == 1 and qat.bias is None
    qat = ConvTranspose2dQAT(4, 4, 3, 2, 1, output_padding=1)  # torch's output_padding: keyword
    qat.train()
    assert qat(torch.randn(1, 4, 5, 5), output_size=[10, 10]).shape[-2:] == (10, 10)


# the page's QAT config: the clips left to training ("clip_min": None)
CONFIG = {
    "retrain_data_config": {
        "dst_type": "INT8",
        "batch_num": 10,
        "fixed_min": False,
        "clip_min": None,
        "clip_max": None
    },
    "retrain_weight_config": {
        "dst_type": "INT8",
        "weights_retrain_algo": "arq_retrain",
        "channel_wise": False
    }
}


def _train(net, data, steps=3):
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    net.train()
    for _ in range(steps):
        loss = net(data).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()


def test_readme_training_from_scratch_flow(monkeypatch, tmp_path):
    """The LeNet of the README, 16x16 inputs. The page exports ``model``, a name it never
    defines (it built ``net``): exported here as ``net``."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    config = CONFIG
    net = torch.nn.Sequential(
        Conv2dQAT(1, 6, kernel_size=5, padding=2, config=config), nn.Sigmoid(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        Conv2dQAT(6, 16, kernel_size=5, config=config), nn.Sigmoid(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Flatten(),
        LinearQAT(16 * 2 * 2, 120, config=config), nn.Sigmoid(),
        LinearQAT(120, 84, config=config), nn.Sigmoid(),
        LinearQAT(84, 10, config=config)
    )
    data = torch.randn(4, 1, 16, 16)
    _train(net, data, steps=10)  # batch_num 10: the clips are set over the first ten batches
    torch.onnx.export(net, (data,), 'inter_model.onnx')
    convert_qat_model('inter_model.onnx', './outputs/lenet')
    with torch.no_grad():
        want = net(data)
    assert close(onnx_run('./outputs/lenet_fake_quant_model.onnx', data), want, 1e-4)
    assert close(onnx_run('./outputs/lenet_deploy_model.onnx', data), want, 0.1)


class Small(nn.Module):
    """Stands in for the page's resnet101(pretrained=True): convs with BatchNorm, a Linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(self.layer1(torch.relu(self.bn1(self.conv1(x)))).mean((2, 3)))


def test_readme_fine_tune_flow(monkeypatch, tmp_path):
    """The README's replacement loop over named_modules, as written; ``data`` is one batch.
    Exported with the TorchScript exporter, torch's default when the page was written (the
    flow above exports with today's default, torch.export)."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = Small()
    config = {**CONFIG, "retrain_weight_config": {**CONFIG["retrain_weight_config"], "channel_wise": True}}

    def _set_module(model, submodule_key, module):
        tokens = submodule_key.split('.')
        sub_tokens = tokens[:-1]
        cur_mod = model
        for s in sub_tokens:
            cur_mod = getattr(cur_mod, s)
        setattr(cur_mod, tokens[-1], module)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d):
            qat_module = Conv2dQAT.from_float(
                module, config=config)
            _set_module(model, name, qat_module)
    assert isinstance(model.layer1[0], Conv2dQAT)
    data = torch.randn(4, 3, 8, 8)
    _train(model, data, steps=10)
    torch.onnx.export(model, (data,), 'inter_model.onnx', dynamo=False)
    convert_qat_model('inter_model.onnx', './outputs/resnet101')
    with torch.no_grad():
        want = model(data)
    assert close(onnx_run('./outputs/resnet101_fake_quant_model.onnx', data), want, 1e-4)


@pytest.mark.parametrize("cls", [LSTMQAT, GRUQAT])
def test_a_model_whose_only_qat_modules_are_recurrent_deploys(monkeypatch, tmp_path, cls):
    """Both converters refused such a model ("no QAT layer found")."""
    import openamct as amct

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    x = torch.randn(5, 2, 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.fc = cls(4, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(self.rnn(x)[0])

    net = Net()
    _train(net, x)
    with torch.no_grad():
        want = net(x)
    torch.onnx.export(net, (x,), "inter.onnx", dynamo=False)
    convert_qat_model("inter.onnx", "./out/a")
    amct.save_quant_retrain_model("unused", net, "unused", "./out/b", (x,))
    for prefix in ("./out/a", "./out/b"):
        assert close(onnx_run(f"{prefix}_fake_quant_model.onnx", x), want, 0.05)
        got = onnx_run(f"{prefix}_deploy_model.onnx", x)
        assert np.isfinite(got).all() and close(got, want, 0.1)
