"""What the three digits retrain examples (prune, quant, compressed) share: their command line
and files, the FP32 model they start from, training, accuracy in torch and in ONNX Runtime, and
the export arguments (named input and output, dynamic batch)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
from torch import nn

from examples.digits import DigitsNet, load_digits
from openamct.demo import bench
from openamct.demo.data import DataSplit
from openamct.demo.train import evaluate, train_epochs

# save_*_retrain_model's export arguments: named input/output, any batch size.
EXPORT_ARGS = {"input_names": ["input"], "output_names": ["logits"],
               "dynamic_axes": {"input": {0: "batch"}, "logits": {0: "batch"}}}


@dataclass
class Start:
    """A script's output folder, its files there, the data and the trained FP32 model (eval mode)."""

    out: str
    epochs: int
    cfg: str
    record: str
    ckpt: str
    data: DataSplit
    model: nn.Module
    x: torch.Tensor  # one sample: only used to capture the graph


def train(model, data, epochs, lr=3e-3, first_epoch=0):
    # Constant lr, epoch e shuffled with seed e: a resumed run sees what an uninterrupted one would.
    train_epochs(model, data.x_train, data.y_train, epochs, batch_size=32, lr=lr, seed=first_epoch,
                 scheduler=None, progress=False)


def torch_accuracy(model, data):
    return evaluate(model, data.x_test, data.y_test)


def onnx_accuracy(path, data):
    return bench.onnx_accuracy(bench.session(path), data.x_test, data.y_test)


def start(description: str, default_out: str, cfg_name: str, config: str) -> Start:
    """Parses ``--epochs`` and ``--out``, writes ``config`` to ``<out>/<cfg_name>``, then trains
    DigitsNet in FP32 for ``--epochs`` epochs from seed 0."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=10, help="FP32 epochs; retraining uses as many")
    p.add_argument("--out", default=default_out)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg = os.path.join(args.out, cfg_name)
    with open(cfg, "w") as f:
        f.write(config)

    torch.manual_seed(0)
    data = load_digits()
    model = DigitsNet()
    train(model, data, args.epochs)
    model.eval()
    x = torch.randn(1, 1, 8, 8)
    return Start(args.out, args.epochs, cfg, os.path.join(args.out, "record.txt"),
                 os.path.join(args.out, "checkpoint.pth"), data, model, x)
