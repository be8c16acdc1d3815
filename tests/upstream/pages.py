"""What the conformance tests share: upstream's call examples run in a folder of their own
with small models and data, and the checks on what a call wrote.

Each test of ``tests/upstream`` restates one call example of upstream AMCT's pages
(``docs/zh/api/<function>.md``, section 调用示例) or of a flow of its ``docs/README.md``, in
our own words: the model and the data are small, the call is made as the page makes it,
``import amct_pytorch as amct`` being ``import openamct as amct``. Where the page itself
cannot run (a positional argument after keywords, a name it never defines), the test says so
and makes the call the page means.
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

INPUT_SHAPE = (2, 3, 8, 8)

INT8_CFG = ("retrain_data_quant_config { ulq_quantize { } }\n"
            "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n")
FILTER_CFG = ("prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 "
              "ascend_optimized: false } } }\n")
NM_CFG = "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 0 } } }\n"


class Net(nn.Module):
    """conv1 -> bn -> relu -> conv2 -> bn2 -> relu2 -> mean -> fc, the layer names of
    upstream's distillation page (its JSON lists ["conv1", "bn", "relu"])."""

    def __init__(self, width: int = 16, outputs: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.fc = nn.Linear(width, outputs)

    def forward(self, x):
        x = self.relu(self.bn(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def build_model() -> Net:
    """Upstream's ``build_model()``: a seeded model with BatchNorm statistics of its own."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        for bn in (model.bn, model.bn2):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 1.5)
    return model.eval()


def write(path: str, text: str) -> str:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def train(model: nn.Module, steps: int = 2, shape: tuple[int, ...] = INPUT_SHAPE) -> None:
    """Upstream's ``train(...)`` then ``infer(...)``: a few SGD steps in training mode (the
    first initialises the activation clips), then one forward in eval mode (which writes the
    record of a compressed model)."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    for _ in range(steps):
        out = model(torch.randn(shape, generator=g))
        loss = out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        model(torch.randn(shape, generator=g))


def onnx_run(path: str, x: torch.Tensor) -> np.ndarray:
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]


def close(got: np.ndarray, want: torch.Tensor, rel: float) -> bool:
    """``got`` within ``rel`` of ``want``'s size (relative L2): a quantized file computes the
    torch model's function up to its rounding."""
    want = want.detach().numpy()
    return float(np.linalg.norm(got - want)) <= rel * float(np.linalg.norm(want))


def saved_pair(save_path: str) -> tuple[str, str]:
    """The two files a save_* call with ``save_path`` writes (upstream's names)."""
    return f"{save_path}_fake_quant_model.onnx", f"{save_path}_deploy_model.onnx"
