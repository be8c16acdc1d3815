"""A conv's ReLU output that only float ops read gets a trained quantizer (techniques/
conv_outputs.py): the ReLU module's own (min pinned at 0) on its output (torchvision
MobileNetV3's squeeze-excitation: the pool and the Mul read the ReLU). The deploy file then runs
that conv as QLinearConv and the SE on uint8, and computes what fake-quant computes; restore
replays it. A conv whose output only a LayerNorm reads, through a permute (ConvNeXt's depthwise
conv), gets an output quantizer. A conv whose ReLU output only the next conv reads keeps what it
had."""

import numpy as np
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.quant.residual import output_hooks
from openamct.record.file_io import read_record
from openamct.techniques.activation_quant import ALGORITHM
from openamct.techniques.base import selective_algorithm
from tests.models import spread_bn_scales
from tests.numerics import assert_same_quantized_function
from tests.runtimes import ort_optimized_ops, ort_run
from tests.training import checkpoint_and_save

CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
"""


class SE(nn.Module):  # torchvision's SqueezeExcitation
    def __init__(self, c: int) -> None:
        super().__init__()
        self.pool, self.fc1, self.relu = nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c, 1), nn.ReLU()
        self.fc2, self.gate = nn.Conv2d(c, c, 1), nn.Hardsigmoid()

    def forward(self, x):
        return self.gate(self.fc2(self.relu(self.fc1(self.pool(x))))) * x


class Net(nn.Module):
    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.stem, self.bn1, self.act1 = nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        self.dw, self.bn2, self.act2 = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        self.se = SE(c)
        self.pw = nn.Conv2d(c, c, 1, bias=False)
        self.norm = nn.LayerNorm(c)
        self.head = nn.Linear(c, 3)

    def forward(self, x):
        x = self.act1(self.bn1(self.stem(x)))  # read by the next conv only: nothing new
        x = self.se(self.act2(self.bn2(self.dw(x))))  # the ReLU's output: the SE's pool and Mul
        y = self.norm(self.pw(x).permute(0, 2, 3, 1))  # read by a LayerNorm only
        return self.head(y.mean((1, 2)))


def _model():
    torch.manual_seed(0)
    return spread_bn_scales(Net())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("convout")
    x = torch.randn(8, 1, 10, 10, generator=torch.Generator().manual_seed(4))
    cfg, rec = str(d / "q.cfg"), str(d / "rec.txt")
    with open(cfg, "w") as f:
        f.write(CFG)
    original = _model()
    c = amct.create_compressed_retrain_model(original, x, cfg, rec)
    assert not output_hooks(original) and not hasattr(original.act2, "output_quant")  # the caller's model untouched
    c.train()
    with torch.no_grad():
        c(x)
    ref, ckpt = checkpoint_and_save(c, d, x, rec)
    return {"c": c, "x": x, "dir": d, "cfg": cfg, "rec": rec, "ckpt": ckpt, "ref": ref}


def test_float_read_conv_outputs_get_trained_quantizers_recorded_and_replayed(saved):
    c, x = saved["c"], saved["x"]
    hooks = dict(output_hooks(c))
    assert sorted(hooks) == ["act2"] and hooks["act2"].quantizer is c.act2.output_quant
    q = c.act2.output_quant
    assert bool(q.initialized) and q.fixed_min and float(q.clip_min) == 0.0  # uint8 zero point 0: ORT drops the Relu
    assert c.stem.out_quant is None and c.dw.out_quant is None  # a layer (and the ReLU's hook) rounds them
    assert c.pw.out_quant is not None and bool(c.pw.out_quant.initialized)  # read by the LayerNorm
    entries = {pr.selective_prune.name: {a.name: a for a in pr.selective_prune.attr}
               for pr in read_record(saved["rec"]).prune_record if selective_algorithm(pr) == ALGORITHM}
    assert entries["act2"]["op"].s == b"relu_output" and entries["pw"]["op"].s == b"output"
    assert (entries["act2"]["scale_d"].floats[0], entries["act2"]["offset_d"].ints[0]) == pytest.approx(q.scale_offset())
    r = amct.restore_compressed_retrain_model(_model(), x, saved["cfg"], saved["rec"], saved["ckpt"], "state_dict")
    r.eval()
    assert sorted(n for n, _ in output_hooks(r)) == ["act2"] and r.act2.output_quant.scale_offset() == q.scale_offset()
    assert r.pw.out_quant.scale_offset() == c.pw.out_quant.scale_offset()
    with torch.no_grad():
        assert np.array_equal(r(x).numpy(), saved["ref"])


def test_deploy_runs_every_conv_in_int8_and_matches_fake_quant(saved):
    d, x = saved["dir"], saved["x"]
    fake = ort_run(str(d / "m_fake_quant_model.onnx"), x)
    assert_same_quantized_function(saved["ref"], fake, what="fake-quant vs torch")
    assert_same_quantized_function(fake, ort_run(str(d / "m_deploy_model.onnx"), x), what="deploy vs fake-quant")
    ops = ort_optimized_ops(str(d / "m_deploy_model.onnx"), d)
    assert ops.count("QLinearConv") >= 5 and not {"Conv", "FusedConv", "Relu"} & set(ops), ops
    assert "QLinearMul" in ops and "QLinearGlobalAveragePool" in ops, ops  # the SE on uint8
