"""Single-op QAT acceptance: ResNet-18 (torchvision's layout, 1-channel stem, 10 classes) on the
demo's 5,000 real MNIST digits, quantized two ways from one float model:

- single-op: every Conv2d and the Linear replaced by ``Conv2dQAT.from_float`` /
  ``LinearQAT.from_float`` (fixed_min true where the layer reads a ReLU output, as the graph
  flow decides it), trained, exported with plain ``torch.onnx.export``, ``convert_qat_model``;
- graph flow: ``create_quant_retrain_model`` with the same INT8 settings, the same training,
  ``save_quant_retrain_model``.

Prints the test accuracy of the float model, of each QAT model in PyTorch and of each deploy
model in ONNX Runtime (target: single-op deploy within 0.3 point of its PyTorch model), and the
deploy latency of both models at batch 1 and 32, interleaved in one process, 2 intra-op threads
(target: single-op within 5 % of the graph flow's). About 5 minutes on 2 quiet cores.

Usage: python benchmarks/single_op_qat.py [--epochs 1] [--qat-epochs 1] [--runs 60]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import openamct as amct  # noqa: E402
from benchmarks.deploy_speed import bench  # noqa: E402
from benchmarks.models import ResNet  # noqa: E402
from openamct.demo.data import batches, load_mnist_5k  # noqa: E402
from openamct.nn.module.quantization import Conv2dQAT, LinearQAT  # noqa: E402


def resnet18_mnist() -> ResNet:
    return ResNet([2, 2, 2, 2], [64, 128, 256, 512], num_classes=10, stem="imagenet", in_channels=1)


def train(model: nn.Module, x, y, epochs: int, lr: float, seed: int = 0) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    model.train()
    t = time.perf_counter()
    for e in range(epochs):
        for xb, yb in batches(x, y, 64, shuffle=True, seed=seed + e):
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    return time.perf_counter() - t


@torch.no_grad()
def accuracy(model: nn.Module, x, y) -> float:
    model.eval()
    return float(sum((model(xb).argmax(1) == yb).sum() for xb, yb in batches(x, y, 250))) / len(y) * 100


def ort_accuracy(path: str, x, y) -> float:
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = s.get_inputs()[0].name
    right = sum(int((s.run(None, {name: xb.numpy()})[0].argmax(1) == yb.numpy()).sum())
                for xb, yb in batches(x, y, 250))
    return right / len(y) * 100


def fed_by_relu(name: str) -> bool:
    """Every layer of this ResNet but the stem conv reads a ReLU output (a block's input, the
    block's middle, the pooled features)."""
    return name != "conv1"


def to_single_op(model: nn.Module) -> nn.Module:
    qat = copy.deepcopy(model)
    for name, m in list(qat.named_modules()):
        cls = {nn.Conv2d: Conv2dQAT, nn.Linear: LinearQAT}.get(type(m))
        if cls is None:
            continue
        cfg = {"retrain_data_config": {"fixed_min": fed_by_relu(name)},
               "retrain_weight_config": {"channel_wise": True}}
        parent, _, leaf = name.rpartition(".")
        setattr(qat.get_submodule(parent) if parent else qat, leaf, cls.from_float(m, cfg))
    return qat


def graph_flow_config(model: nn.Module, path: str) -> None:
    layers = {n: {"retrain_enable": True, "retrain_data_config": {"fixed_min": fed_by_relu(n)},
                  "retrain_weight_config": {"algo": "arq_retrain", "channel_wise": True}}
              for n, m in model.named_modules() if type(m) in (nn.Conv2d, nn.Linear)}
    with open(path, "w") as f:
        json.dump({"version": 1, "batch_num": 1, **layers}, f)


def kernels(path: str, folder: str) -> list[str]:
    so = ort.SessionOptions()
    so.optimized_model_filepath = os.path.join(folder, "opt.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return sorted(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--qat-epochs", type=int, default=1)
    p.add_argument("--runs", type=int, default=60)
    args = p.parse_args()
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load_mnist_5k()
    fp32 = resnet18_mnist()
    secs = train(fp32, x_tr, y_tr, args.epochs, 0.05)
    print(f"float ResNet-18: {accuracy(fp32, x_te, y_te):.1f} % test accuracy ({secs:.0f} s training)")
    dyn = {"x": {0: "n"}}
    with tempfile.TemporaryDirectory() as d:
        single = to_single_op(fp32)
        torch.manual_seed(1)
        secs = train(single, x_tr, y_tr, args.qat_epochs, 0.005, seed=10)
        torch.onnx.export(single, (x_te[:1],), os.path.join(d, "qat.onnx"), input_names=["x"], output_names=["y"],
                          dynamic_axes=dyn, dynamo=False)
        amct.convert_qat_model(os.path.join(d, "qat.onnx"), os.path.join(d, "single"))
        s_torch = accuracy(single, x_te, y_te)
        s_fake = ort_accuracy(os.path.join(d, "single_fake_quant_model.onnx"), x_te, y_te)
        s_dep = ort_accuracy(os.path.join(d, "single_deploy_model.onnx"), x_te, y_te)
        print(f"single-op QAT ({secs:.0f} s): PyTorch {s_torch:.1f} %, fake-quant ONNX {s_fake:.1f} %, "
              f"deploy ONNX {s_dep:.1f} % (deploy - PyTorch {s_dep - s_torch:+.1f} point; target within 0.3)")

        cfg = os.path.join(d, "quant.json")
        graph_flow_config(fp32, cfg)
        graph = amct.create_quant_retrain_model(cfg, copy.deepcopy(fp32), os.path.join(d, "rec.txt"), (x_tr[:64],))
        torch.manual_seed(1)
        secs = train(graph, x_tr, y_tr, args.qat_epochs, 0.005, seed=10)
        amct.save_quant_retrain_model(cfg, graph, os.path.join(d, "rec.txt"), os.path.join(d, "graph"), (x_te[:1],),
                                      input_names=["x"], output_names=["y"], dynamic_axes=dyn)
        g_torch = accuracy(graph, x_te, y_te)
        g_dep = ort_accuracy(os.path.join(d, "graph_deploy_model.onnx"), x_te, y_te)
        print(f"graph-flow QAT ({secs:.0f} s): PyTorch {g_torch:.1f} %, deploy ONNX {g_dep:.1f} %")

        ks, kg = kernels(os.path.join(d, "single_deploy_model.onnx"), d), kernels(
            os.path.join(d, "graph_deploy_model.onnx"), d)
        print(f"ORT kernels: single-op {ks.count('QLinearConv')} QLinearConv, {ks.count('QLinearAdd')} QLinearAdd; "
              f"graph flow {kg.count('QLinearConv')} QLinearConv, {kg.count('QLinearAdd')} QLinearAdd; "
              f"same optimised graph ops: {ks == kg}")
        paths = {"single-op": os.path.join(d, "single_deploy_model.onnx"),
                 "graph flow": os.path.join(d, "graph_deploy_model.onnx")}
        for n in (1, 32):
            xb = np.ascontiguousarray(x_te[:n].numpy())
            t = bench(paths, xb, args.runs)
            print(f"deploy latency batch {n}: single-op {t['single-op']:.3f} ms, graph flow {t['graph flow']:.3f} ms "
                  f"(single-op / graph flow {t['single-op'] / t['graph flow']:.3f}; target <= 1.05)")


if __name__ == "__main__":
    main()
