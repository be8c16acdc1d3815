"""A conv whose output a float BatchNormalization reads (timm's BatchNormAct2d calls
F.batch_norm, which create does not fold into the conv): the deploy file puts no output Q/DQ
there, which fake-quant does not have, and so computes the fake-quant file's function."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

import openamct as amct

QUANT_CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
"""


class FunctionalBN(nn.Module):
    """BatchNorm through F.batch_norm, as timm's BatchNormAct2d runs it."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(0.75 + 0.5 * torch.rand(c)), nn.Parameter(0.1 * torch.randn(c))
        self.register_buffer("running_mean", 0.1 * torch.randn(c))
        self.register_buffer("running_var", 0.5 + torch.rand(c))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, 1e-5)


class Net(nn.Module):
    """conv -> functional BN -> GELU, twice, then pool and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(3, 16, 3, padding=1), FunctionalBN(16)
        self.c2, self.n2 = nn.Conv2d(16, 16, 3, padding=1), FunctionalBN(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.gelu(self.n1(self.c1(x)))
        x = F.gelu(self.n2(self.c2(x)))
        return self.fc(x.mean((2, 3)))


def _run(path: str, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_no_deploy_only_quantizer_before_a_float_batchnorm(tmp_path):
    torch.manual_seed(0)
    model = Net().eval()
    cfg, rec = tmp_path / "q.cfg", tmp_path / "rec.txt"
    cfg.write_text(QUANT_CFG)
    x = torch.randn(4, 3, 16, 16)
    c = amct.create_compressed_retrain_model(model, x, str(cfg), str(rec))
    c.train()
    with torch.no_grad():
        for _ in range(3):
            c(torch.randn(4, 3, 16, 16))
    c.eval()
    prefix = str(tmp_path / "m")
    amct.save_compressed_retrain_model(c, str(rec), prefix, x, input_names=["x"])
    graph = onnx.load(prefix + "_deploy_model.onnx").graph
    producer = {o: n for n in graph.node for o in n.output}
    bns = [n for n in graph.node if n.op_type == "BatchNormalization"]
    assert len(bns) == 2
    assert all(producer[n.input[0]].op_type == "Conv" for n in bns), [producer[n.input[0]].op_type for n in bns]
    xs = torch.randn(4, 3, 16, 16).numpy()
    fake, deploy = _run(prefix + "_fake_quant_model.onnx", xs), _run(prefix + "_deploy_model.onnx", xs)
    cos = float((fake * deploy).sum() / (np.linalg.norm(fake) * np.linalg.norm(deploy)))
    assert cos >= 0.9999, cos
