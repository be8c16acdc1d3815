"""A layer whose weight a torch function also reads (``F.linear(h, self.l1.weight)``,
``F.conv2d(y, self.c2.weight)``) stays float: both ONNX files then compute what the trained
model computes, instead of reading a folded or placeholder weight in the second use."""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import openamct as amct

QUANT = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"


class LinearTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        return self.l2(h + F.linear(h, self.l1.weight))


class ConvTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.c2(torch.relu(self.c1(x))))
        y = y + F.conv2d(y, self.c2.weight, padding=1)
        return self.fc(y.mean(dim=(2, 3)))


@pytest.mark.parametrize("cls,shape,layer", [(LinearTwice, (4, 8), "l1"), (ConvTwice, (2, 3, 8, 8), "c2")])
def test_a_weight_used_functionally_exports_the_trained_function(tmp_path, caplog, cls, shape, layer):
    (tmp_path / "q.cfg").write_text(QUANT)
    torch.manual_seed(0)
    x = torch.randn(*shape)
    with caplog.at_level(logging.WARNING):
        m = amct.create_compressed_retrain_model(cls(), x, str(tmp_path / "q.cfg"), str(tmp_path / "r.txt"))
    assert "its weight is also read outside its own forward" in caplog.text and layer in caplog.text
    m.train()
    m(x)
    m.eval()
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "m"), x)
    with torch.no_grad():
        want = m(x).numpy()
    for kind in ("fake_quant", "deploy"):
        sess = ort.InferenceSession(str(tmp_path / f"m_{kind}_model.onnx"), providers=["CPUExecutionProvider"])
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        # the other layers are quantized: deploy may land a grid step apart, never 0.2 off
        assert np.abs(got - want).max() < 0.02 * np.abs(want).max(), (kind, np.abs(got - want).max())
