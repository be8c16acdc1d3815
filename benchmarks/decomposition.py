"""Tensor decomposition, measured: auto_decomposition -> fine-tune -> INT8 QAT -> save.

MNIST (the demo's MnistNet on the offline 5k digits): train FP32, decompose (upstream's rule
takes layer4.0 only: the other convs have fewer than 64 channels on a side), fine-tune, then
INT8 QAT of the decomposed model and, for comparison, of the undecomposed one, same epochs.
Checks on the way: decompose_network + the fine-tuned checkpoint rebuild the fine-tuned model
exactly, and restore_compressed_retrain_model with the record + the QAT checkpoint (on the
structure decompose_network rebuilds) reproduces the QAT model exactly.

HF ResNet-50 (transformers ResNetForImageClassification from its default config, random
weights, no download): speed only. Every 3x3 conv and the 7x7 stem qualify.

Reported: MACs and parameters before/after; ONNX Runtime latency (CPU, 2 intra-op threads) of
FP32 original vs FP32 decomposed, and of the INT8 deploy models with and without
decomposition, all sessions of a model timed interleaved in one process (round robin, order
rotated each round, medians), so the ratios hold on a shared machine; MNIST accuracy.

Measured with the defaults (2 shared cores, torch 2.13 CPU, ORT 1.32; 3.5 minutes):
  MnistNet  MACs 10.95M -> 8.54M, params 98.7k -> 43.4k; accuracy FP32 98.7 %, decomposed +
            fine-tuned 98.7 %, INT8 98.9 %, decomposed + INT8 98.7 %; batch 64: decomposed FP32
            1.02x FP32's speed, decomposed INT8 0.93x plain INT8's
  ResNet-50 MACs 4087M -> 2980M, params 23.5M -> 16.7M; batch 1: decomposed FP32 1.41x, INT8
            3.07x, decomposed INT8 3.97x FP32's speed (1.30x plain INT8's)
Both exact-rebuild checks print True. More runs and what they mean: docs/decomposition.md.

Usage: python benchmarks/decomposition.py [--epochs 10] [--ft-epochs 3] [--qat-epochs 2]
       [--runs 40] [--only mnist,resnet50] [--keep DIR]
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import openamct as amct  # noqa: E402
from benchmarks.deploy_speed import bench, session  # noqa: E402
from openamct.stats import count_macs, count_params  # noqa: E402

INT8_CFG = """retrain_data_quant_config { ulq_quantize { dst_type: INT8 } }
retrain_weight_quant_config { arq_retrain { channel_wise: true dst_type: INT8 } }
"""


def export_fp32(model: nn.Module, x: torch.Tensor, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (x,), path, dynamo=False, opset_version=17, input_names=["x"],
                          dynamic_axes={"x": [0]})


def qat(model: nn.Module, cfg_text: str, folder: str, tag: str, x_cal: torch.Tensor, train=None):
    """create_compressed_retrain_model, ``train(model)`` (or a few calibration forwards), save.
    Returns (compressed model, deploy ONNX path, config path, record path)."""
    cfg, rec = os.path.join(folder, f"{tag}.cfg"), os.path.join(folder, f"{tag}_record.txt")
    with open(cfg, "w") as f:
        f.write(cfg_text)
    c = amct.create_compressed_retrain_model(model, x_cal[:1], cfg, rec)
    if train is not None:
        train(c)
    else:
        c.train()
        with torch.no_grad():
            for xb in x_cal.split(max(1, len(x_cal) // 4)):
                c(xb)
    c.eval()
    prefix = os.path.join(folder, tag)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amct.save_compressed_retrain_model(c, rec, prefix, x_cal[:1], input_names=["x"], dynamic_axes={"x": [0]})
    return c, prefix + "_deploy_model.onnx", cfg, rec


def onnx_accuracy(path: str, x: torch.Tensor, y: torch.Tensor) -> float:
    s = session(path)
    name = s.get_inputs()[0].name
    pred = np.concatenate([s.run(None, {name: xb.numpy()})[0].argmax(1) for xb in x.split(250)])
    return float((pred == y.numpy()).mean())


def size_row(title: str, before: nn.Module, after: nn.Module, x: torch.Tensor) -> None:
    m0, m1 = count_macs(before, x), count_macs(after, x)
    p0, p1 = count_params(before), count_params(after)
    print(f"  {title}: MACs {m0 / 1e6:.2f}M -> {m1 / 1e6:.2f}M ({m0 / m1:.2f}x fewer), "
          f"params {p0 / 1e3:.1f}k -> {p1 / 1e3:.1f}k ({p0 / p1:.2f}x fewer)")


def latency_rows(paths: dict[str, str], x: np.ndarray, runs: int) -> None:
    ms = bench(paths, x, runs)
    base = ms["fp32"]
    for k, v in ms.items():
        print(f"    {k:<14} {v:8.2f} ms  ({base / v:.2f}x vs fp32)")
    print(f"    decomposed fp32 vs fp32: {ms['fp32'] / ms['fp32_dec']:.2f}x; decomposed int8 vs int8: "
          f"{ms['int8'] / ms['int8_dec']:.2f}x; decomposed int8 vs fp32: {ms['fp32'] / ms['int8_dec']:.2f}x")


def mnist(folder: str, args) -> None:
    from openamct.demo.data import load_mnist_5k
    from openamct.demo.models import MnistNet
    from openamct.demo.train import evaluate, train_mnist

    print("MNIST (demo MnistNet, load_mnist_5k: 4000 train / 1000 test)")
    x_tr, y_tr, x_te, y_te = load_mnist_5k()
    torch.manual_seed(0)
    t0 = time.time()
    fp32 = MnistNet()
    train_mnist(fp32, x_tr, y_tr, epochs=args.epochs, progress=False)
    acc_fp32 = evaluate(fp32, x_te, y_te)
    info = os.path.join(folder, "decompose_info.json")
    dec, changes = amct.auto_decomposition(copy.deepcopy(fp32), info)  # in place: keep fp32 to compare
    print(f"  changes: {changes}")
    size_row("MnistNet", fp32, dec, x_te[:1])
    with torch.no_grad():
        ref, got = fp32.eval()(x_te), dec.eval()(x_te)
    acc_dec0 = evaluate(dec, x_te, y_te)
    print(f"  before fine-tuning: logits relative L2 {float((got - ref).norm() / ref.norm()):.3f}, "
          f"accuracy {acc_dec0:.2%} (FP32 {acc_fp32:.2%})")
    train_mnist(dec, x_tr, y_tr, epochs=args.ft_epochs, lr=1e-3, seed=1, progress=False)
    acc_ft = evaluate(dec, x_te, y_te)
    ckpt = os.path.join(folder, "decomposed.pth")
    torch.save(dec.state_dict(), ckpt)
    rebuilt, _ = amct.decompose_network(MnistNet(), info)
    rebuilt.load_state_dict(torch.load(ckpt))
    with torch.no_grad():
        exact = torch.equal(rebuilt.eval()(x_te), dec.eval()(x_te))
    print(f"  after {args.ft_epochs} fine-tuning epochs: accuracy {acc_ft:.2%} ({(acc_ft - acc_fp32) * 100:+.2f} "
          f"points vs FP32); decompose_network + checkpoint reproduce it exactly: {exact}")

    def qat_train(c):
        train_mnist(c, x_tr, y_tr, epochs=args.qat_epochs, lr=5e-4, seed=2, progress=False)

    cfg_text = INT8_CFG + 'quant_skip_layers: "layer1.0"\n'  # as the demo: a 1-channel QLinearConv is slow
    q_dec, p_dec, cfg, rec = qat(dec, cfg_text, folder, "int8_dec", x_tr[:64], qat_train)
    q_org, p_org, _, _ = qat(fp32, cfg_text, folder, "int8", x_tr[:64], qat_train)
    qck = os.path.join(folder, "int8_dec.pth")
    torch.save(q_dec.state_dict(), qck)
    structure, _ = amct.decompose_network(MnistNet(), info)
    restored = amct.restore_compressed_retrain_model(structure, x_tr[:1], cfg, rec, qck)
    with torch.no_grad():
        exact_q = torch.equal(restored.eval()(x_te), q_dec.eval()(x_te))
    fp_path, fp_dec_path = os.path.join(folder, "fp32.onnx"), os.path.join(folder, "fp32_dec.onnx")
    export_fp32(fp32, x_te[:1], fp_path)
    export_fp32(dec, x_te[:1], fp_dec_path)
    accs = {k: onnx_accuracy(p, x_te, y_te) for k, p in
            (("fp32", fp_path), ("fp32_dec", fp_dec_path), ("int8", p_org), ("int8_dec", p_dec))}
    print(f"  after {args.qat_epochs} INT8 QAT epochs, ORT accuracy: " +
          ", ".join(f"{k} {v:.2%}" for k, v in accs.items()))
    print(f"  decomposed + INT8 vs FP32: {(accs['int8_dec'] - accs['fp32']) * 100:+.2f} points; "
          f"restore (decompose_network + record + checkpoint) reproduces the QAT model exactly: {exact_q}")
    print(f"  ORT latency, batch 64, {args.runs} runs each, interleaved:")
    latency_rows({"fp32": fp_path, "fp32_dec": fp_dec_path, "int8": p_org, "int8_dec": p_dec},
                 x_te[:64].numpy(), args.runs)
    print(f"  ({time.time() - t0:.0f} s)")


class Logits(nn.Module):
    """HF image classifier -> plain logits tensor (for export and the pipeline)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


def resnet50(folder: str, args) -> None:
    from transformers import ResNetConfig, ResNetForImageClassification

    print("HF ResNet-50 (ResNetForImageClassification, default config, random weights: speed only)")
    t0 = time.time()
    torch.manual_seed(0)
    model = Logits(ResNetForImageClassification(ResNetConfig())).eval()
    x = torch.randn(1, 3, 224, 224)
    work = copy.deepcopy(model)  # auto_decomposition works in place: model is kept to compare
    t = time.time()
    dec, changes = amct.auto_decomposition(work)
    print(f"  auto_decomposition: {len(changes)} convs in {time.time() - t:.1f} s")
    size_row("ResNet-50", model, dec, x)
    with torch.no_grad():
        ref, got = model(x), dec.eval()(x)
    print(f"  decomposed vs original logits before fine-tuning (random weights): relative L2 "
          f"{float((got - ref).norm() / ref.norm()):.3f}")
    fp_path, fp_dec_path = os.path.join(folder, "r50_fp32.onnx"), os.path.join(folder, "r50_fp32_dec.onnx")
    export_fp32(model, x, fp_path)
    export_fp32(dec, x, fp_dec_path)
    x_cal = torch.randn(8, 3, 224, 224)
    _, p_org, _, _ = qat(model, INT8_CFG, folder, "r50_int8", x_cal)
    _, p_dec, _, _ = qat(dec, INT8_CFG, folder, "r50_int8_dec", x_cal)
    print(f"  ORT latency, batch 1, {args.runs} runs each, interleaved:")
    latency_rows({"fp32": fp_path, "fp32_dec": fp_dec_path, "int8": p_org, "int8_dec": p_dec}, x.numpy(), args.runs)
    print(f"  ({time.time() - t0:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=10, help="FP32 training epochs (MNIST)")
    ap.add_argument("--ft-epochs", type=int, default=3, help="fine-tuning epochs after decomposition")
    ap.add_argument("--qat-epochs", type=int, default=2, help="INT8 QAT epochs (both INT8 models)")
    ap.add_argument("--runs", type=int, default=40, help="timed runs per ORT session")
    ap.add_argument("--only", default="mnist,resnet50")
    ap.add_argument("--keep", default=None, help="keep the files in this folder")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # As the demo trains: one torch thread (a 2-thread OpenMP pool on a loaded machine spends
    # much of its time waiting for its second thread) and denormals flushed (they slow small
    # CNNs' training many times over).
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    print(f"torch {torch.__version__} (1 thread), {os.cpu_count()} CPUs, ORT 2 intra-op threads")
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        for part in args.only.split(","):
            {"mnist": mnist, "resnet50": resnet50}[part](folder, args)


if __name__ == "__main__":
    main()
