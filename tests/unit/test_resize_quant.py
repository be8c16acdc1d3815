"""A nearest-neighbour upsampling copies values, so a quantized tensor stays on its grid through
it: a conv whose output an ``nn.Upsample(mode="nearest")`` or ``F.interpolate`` passes to a sum
(HRNet's fuse layers) gets a trained output quantizer, ORT resizes the uint8 tensor and adds in
int8, and the deploy file computes what fake-quant does. A bilinear one reads float."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import openamct as amct
from tests.numerics import cosine
from tests.runtimes import ort_run
from tests.training import checkpoint_and_save, sgd_steps

CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
"""


def _cbn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout))


class Fuse(nn.Module):
    """Two resolutions; the low one upsampled into the high one's sum, then a conv reads it."""

    def __init__(self, mode: str = "nearest", functional: bool = False) -> None:
        super().__init__()
        self.mode, self.functional = mode, functional
        self.high = _cbn(3, 8)
        self.low = _cbn(3, 8, stride=2)
        self.up = nn.Upsample(scale_factor=2, mode=mode)
        self.out = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        low = self.low(x)
        low = F.interpolate(low, scale_factor=2.0, mode=self.mode) if self.functional else self.up(low)
        y = torch.relu(self.high(x) + low)
        return self.fc(torch.relu(self.out(y)).mean((2, 3)))


def _model(**kw):
    torch.manual_seed(0)
    m = Fuse(**kw)
    with torch.no_grad():
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.weight.uniform_(0.75, 1.25)
                bn.running_var.uniform_(0.5, 1.5)
    return m.eval()


def _run(tmp_path, **kw):
    cfg, rec = str(tmp_path / "q.cfg"), str(tmp_path / "rec.txt")
    with open(cfg, "w") as f:
        f.write(CFG)
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    c = amct.create_compressed_retrain_model(_model(**kw), x, cfg, rec)
    sgd_steps(c, lambda m: m(torch.randn(4, 3, 16, 16)), steps=2, lr=1e-3)
    ref, _ = checkpoint_and_save(c, tmp_path, x, rec)
    return c, x, ref


def _source(g, t: str) -> str:
    """The op producing ``t`` in ``g``, past ORT's layout Transposes."""
    producer = {o: n for n in g.node for o in n.output}
    n = producer[t]
    while n.op_type == "Transpose":
        n = producer[n.input[0]]
    return n.op_type


def _optimised(path, folder):
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(folder / "opt.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return onnx.load(so.optimized_model_filepath).graph


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
def test_nearest_upsampling_runs_on_uint8(tmp_path, functional):
    c, x, ref = _run(tmp_path, functional=functional)
    assert c.low[0].out_quant is not None  # the sum reads it through the upsampling
    g = _optimised(tmp_path / "m_deploy_model.onnx", tmp_path)
    ops = collections.Counter(n.op_type for n in g.node)
    assert ops["Conv"] == 0 and ops["QLinearAdd"] == 1, ops
    resize = [n for n in g.node if n.op_type == "Resize"]
    assert len(resize) == 1 and _source(g, resize[0].input[0]) == "QLinearConv"  # uint8 in
    fake = ort_run(tmp_path / "m_fake_quant_model.onnx", x)
    deploy = ort_run(tmp_path / "m_deploy_model.onnx", x, optimised=True)
    assert np.abs(fake - ref).max() <= 1e-4 * np.abs(ref).max()
    assert cosine(deploy, fake) >= 0.9999


def test_bilinear_upsampling_reads_float(tmp_path):
    c, x, ref = _run(tmp_path, mode="bilinear")
    assert c.low[0].out_quant is None
    g = _optimised(tmp_path / "m_deploy_model.onnx", tmp_path)
    resize = [n for n in g.node if n.op_type == "Resize"]
    assert len(resize) == 1 and _source(g, resize[0].input[0]) != "QLinearConv"
    fake = ort_run(tmp_path / "m_fake_quant_model.onnx", x)
    deploy = ort_run(tmp_path / "m_deploy_model.onnx", x, optimised=True)
    assert cosine(deploy, fake) >= 0.9999
