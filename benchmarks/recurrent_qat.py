"""Acceptance run for LSTM QAT: an LSTM classifier on the demo's MNIST read row by row (28 steps
of 28 features), trained FP32, then QAT through ``create_quant_retrain_model``, saved, and run
in ONNX Runtime.

Prints: FP32 and QAT accuracies (torch, fake-quant ONNX, deploy ONNX, and the deploy file
rewritten to ORT's ``DynamicQuantizeLSTM``), the cosine of the fake-quant ONNX's logits to the
torch QAT model's, and ORT latency of the FP32 export vs both deploy forms at batch 1 and 32
(interleaved round robin, median of blocks; ``--threads`` intra-op threads). Test set: the
demo's 1,000 held-out digits. About 5 minutes on a quiet 2-core machine (FP32 training 2.3
minutes, QAT 3: the quantized recurrence runs step by step in Python); docs/export.md has the
figures.

Usage: python benchmarks/recurrent_qat.py [--hidden 128] [--epochs 8] [--qat-epochs 2] [--runs 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import openamct as amct  # noqa: E402
from openamct.demo.data import batches, load_mnist_5k  # noqa: E402

BLOCK = 5


class RowLSTM(nn.Module):
    """Each image row is one step: LSTM(28 -> hidden) -> last step's state -> Linear(hidden -> 10)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(28, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, 10)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.fc(y[:, -1])


def rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(len(x), 28, 28)


def train(model, x, y, epochs: int, lr: float, seed: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * ((len(x) + 63) // 64))
    model.train()
    for ep in range(epochs):
        for xb, yb in batches(x, y, 64, shuffle=True, seed=seed + ep):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    model.eval()


@torch.no_grad()
def torch_logits(model, x) -> np.ndarray:
    return torch.cat([model(xb) for xb, _ in batches(x, x[:, 0, 0], 256)]).numpy()


def session(path: str, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def ort_logits(path: str, x: torch.Tensor, threads: int) -> np.ndarray:
    s = session(path, threads)
    name = s.get_inputs()[0].name
    return np.concatenate([s.run(None, {name: xb.numpy()})[0] for xb, _ in batches(x, x[:, 0, 0], 256)])


def accuracy(logits: np.ndarray, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y.numpy()).mean() * 100)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def bench(paths: dict[str, str], x: np.ndarray, runs: int, threads: int) -> dict[str, float]:
    sess = {k: session(p, threads) for k, p in paths.items()}
    names = list(sess)
    feeds = {k: {s.get_inputs()[0].name: x} for k, s in sess.items()}
    for k in names:
        for _ in range(3):
            sess[k].run(None, feeds[k])
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(max(1, runs // BLOCK)):
        for k in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(0.05)  # the previous ORT run's spinning threads go idle first
            for i in range(BLOCK + 1):
                t = time.perf_counter()
                sess[k].run(None, feeds[k])
                if i:
                    times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--qat-epochs", type=int, default=2)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    x_tr, y_tr, x_te, y_te = load_mnist_5k(seed=args.seed)
    x_tr, x_te = rows(x_tr), rows(x_te)
    model = RowLSTM(args.hidden)
    t0 = time.time()
    train(model, x_tr, y_tr, args.epochs, 3e-3, args.seed)
    fp32_acc = accuracy(torch_logits(model, x_te), y_te)
    print(f"FP32: {fp32_acc:.1f}% ({time.time() - t0:.0f} s, {args.epochs} epochs, hidden {args.hidden})")
    with tempfile.TemporaryDirectory() as tmp:
        cfg, rec = os.path.join(tmp, "q.json"), os.path.join(tmp, "record.txt")
        amct.create_quant_retrain_config(cfg, model, x_tr[:64])
        t0 = time.time()
        qat = amct.create_quant_retrain_model(cfg, model, rec, x_tr[:64])
        train(qat, x_tr, y_tr, args.qat_epochs, 3e-4, args.seed + 100)
        torch_q = torch_logits(qat, x_te)
        print(f"QAT torch: {accuracy(torch_q, y_te):.1f}% ({time.time() - t0:.0f} s, {args.qat_epochs} epochs)")
        prefix = os.path.join(tmp, "rowlstm")
        amct.save_quant_retrain_model(cfg, qat, rec, prefix, x_te[:1], input_names=["x"],
                                      dynamic_axes={"x": [0]})
        fake, deploy = prefix + "_fake_quant_model.onnx", prefix + "_deploy_model.onnx"
        dyn = prefix + "_dynamic_lstm.onnx"
        amct.dynamic_quantize_lstm(deploy, dyn)
        fp32 = os.path.join(tmp, "fp32.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (x_te[:1],), fp32, dynamo=False, opset_version=17, input_names=["x"],
                              dynamic_axes={"x": [0]})
        fake_q = ort_logits(fake, x_te, args.threads)
        print(f"fake-quant ONNX (ORT): {accuracy(fake_q, y_te):.1f}%, cosine to torch QAT {cosine(fake_q, torch_q):.6f}")
        for tag, path in (("deploy (DQ int8 -> LSTM)", deploy), ("deploy (DynamicQuantizeLSTM)", dyn)):
            got = ort_logits(path, x_te, args.threads)
            print(f"{tag}: {accuracy(got, y_te):.1f}% (FP32 {fp32_acc:.1f}%), cosine to torch QAT "
                  f"{cosine(got, torch_q):.6f}")
        paths = {"fp32": fp32, "deploy_dq": deploy, "dynamic_lstm": dyn}
        for b in (1, 32):
            ms = bench(paths, x_te[:b].numpy(), args.runs, args.threads)
            print(f"ORT latency batch {b}: " + " | ".join(
                f"{k} {v:.3f} ms ({ms['fp32'] / v:.2f}x)" for k, v in ms.items()))


if __name__ == "__main__":
    main()
