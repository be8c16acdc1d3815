"""Which residual tensors training rounds, and that the deploy file rounds no other.

torchvision's Bottleneck calls one ``self.relu`` three times; its block output (that ReLU's
last call) is read by the next block's conv and its Add. A hook on the ReLU would fire on all
three calls, so the tensor is named by the innermost module called once: the block. Where no
module returns the tensor (a functional ReLU inside a block), training adds it unrounded, and
so must the deploy file: its Add reads the float tensor, not the next conv's Q/DQ of it."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import openamct as amct
from openamct.quant.residual import output_hooks
from tests.numerics import cosine
from tests.runtimes import ort_optimized_ops, ort_run
from tests.training import checkpoint_and_save, sgd_steps

CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
"""


class Bottleneck(nn.Module):
    """torchvision's: one ReLU module, called after each conv and after the sum."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class Functional(nn.Module):
    """A sum whose residual term a functional ReLU makes: no module returns it."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.conv1(x))
        return self.conv2(y) + y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.b1, self.b2, self.b3 = Bottleneck(16), Bottleneck(16), Functional(16)
        self.head = nn.Conv2d(16, 32, 1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.head(self.b3(self.b2(self.b1(self.stem(x)))))
        return self.fc(x.mean((2, 3)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("rn")
    cfg, rec = str(d / "q.cfg"), str(d / "rec.txt")
    with open(cfg, "w") as f:
        f.write(CFG)
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    c = amct.create_compressed_retrain_model(model, x, cfg, rec)
    sgd_steps(c, lambda m: m(torch.randn(4, 3, 16, 16)), steps=2, lr=1e-3)
    ref, _ = checkpoint_and_save(c, d, x, rec)
    return {"dir": d, "x": x, "ref": ref, "model": c}


def test_a_block_output_is_named_by_the_block(saved):
    hooks = dict(output_hooks(saved["model"]))
    # the stem's ReLU, called once, names its own output; b1's output is its shared ReLU's last call
    assert sorted(hooks) == ["b1", "stem.2"]
    assert hooks["b1"].quantizer is saved["model"].b2.conv1.act_quant


def test_deploy_adds_what_training_adds(saved):
    d = saved["dir"]
    ops = ort_optimized_ops(d / "m_deploy_model.onnx", d)
    # the two Bottleneck sums read quantized tensors: int8 adds; the functional block's stays float
    assert ops.count("QLinearAdd") == 2 and ops.count("Add") == 1, ops
    fake = ort_run(d / "m_fake_quant_model.onnx", saved["x"])
    deploy = ort_run(d / "m_deploy_model.onnx", saved["x"], optimised=True)
    assert np.abs(fake - saved["ref"]).max() <= 1e-4 * np.abs(saved["ref"]).max()
    assert cosine(deploy, fake) >= 0.99999
