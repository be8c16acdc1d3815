"""How faithful the single-op QAT deploy file is, against the graph flow's: torchvision's
ResNet-18 (random weights, BatchNorm statistics set on the data, 10 classes), quantized two
ways from one float model with the same INT8 settings:

- single-op: every Conv2d and the Linear replaced by ``Conv2dQAT.from_float`` /
  ``LinearQAT.from_float`` (fixed_min where the layer reads a ReLU output, as the graph flow
  decides it), then ``save_quant_retrain_model`` (export + ``convert_qat_model``);
- graph flow: ``create_quant_retrain_model`` and ``save_quant_retrain_model``.

Both QAT models get the same steps (SGD towards the float model's logits on random images),
then each deploy file runs in ONNX Runtime on held-out images and is compared with its own
PyTorch QAT model in eval mode: relative L2 of the logits (||deploy - torch|| / ||torch||)
and the share of images whose argmax agrees; then the integer kernels ONNX Runtime runs in
each file and their latency (batch 1 and 16, interleaved, 2 intra-op threads). About two
minutes on 2 cores.

Usage: python benchmarks/single_op_fidelity.py [--steps 20] [--images 64] [--size 64] [--runs 60]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import openamct as amct  # noqa: E402
from benchmarks.deploy_speed import bench  # noqa: E402
from benchmarks.single_op_qat import graph_flow_config, kernels, to_single_op  # noqa: E402
from tests.zoo.torchvision_ops import vision_modules  # noqa: E402


def set_bn_statistics(model: nn.Module, images: torch.Tensor) -> None:
    """Running statistics of every BatchNorm from ``images`` (a cumulative average), as a
    trained model has them; random weights with default statistics make activations explode."""
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for xb in images.split(32):
            model(xb)
    for m in bns:
        m.momentum = 0.1
    model.eval()


def qat_steps(model: nn.Module, teacher: nn.Module, images: torch.Tensor, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model.train()
    g = torch.Generator().manual_seed(10)
    for _ in range(steps):
        xb = images[torch.randint(len(images), (16,), generator=g)]
        with torch.no_grad():
            want = teacher(xb)
        loss = nn.functional.mse_loss(model(xb), want)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def compare(path: str, model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    got = np.concatenate([s.run(None, {s.get_inputs()[0].name: xb.numpy()})[0] for xb in x.split(16)])
    with torch.no_grad():
        want = torch.cat([model(xb) for xb in x.split(16)]).numpy()
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    return rel, float((got.argmax(1) == want.argmax(1)).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--images", type=int, default=64, help="held-out images compared")
    p.add_argument("--size", type=int, default=64, help="image side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=60, help="timed runs per file and batch size (0: no timing)")
    args = p.parse_args()
    tv, _ = vision_modules()
    torch.manual_seed(args.seed)
    fp32 = tv.models.resnet18(num_classes=10)
    train = torch.randn(256, 3, args.size, args.size)
    test = torch.randn(args.images, 3, args.size, args.size)
    set_bn_statistics(fp32, train)
    dyn = {"x": {0: "n"}, "y": {0: "n"}}
    names = {"input_names": ["x"], "output_names": ["y"], "dynamic_axes": dyn}
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        single = to_single_op(fp32)
        qat_steps(single, fp32, train, args.steps)
        amct.save_quant_retrain_model("unused.json", single, "unused.txt", os.path.join(d, "single"), (test[:1],), **names)
        s_rel, s_arg = compare(os.path.join(d, "single_deploy_model.onnx"), single, test)
        print(f"single-op: deploy vs torch relative L2 {s_rel:.4f}, argmax agreement {s_arg:.3f} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        t = time.perf_counter()
        cfg = os.path.join(d, "quant.json")
        graph_flow_config(fp32, cfg)
        graph = amct.create_quant_retrain_model(cfg, fp32, os.path.join(d, "rec.txt"), (train[:16],))
        qat_steps(graph, fp32, train, args.steps)
        amct.save_quant_retrain_model(cfg, graph, os.path.join(d, "rec.txt"), os.path.join(d, "graph"), (test[:1],),
                                      **names)
        g_rel, g_arg = compare(os.path.join(d, "graph_deploy_model.onnx"), graph, test)
        print(f"graph flow: deploy vs torch relative L2 {g_rel:.4f}, argmax agreement {g_arg:.3f} "
              f"({time.perf_counter() - t:.0f} s)")
        paths = {"single-op": os.path.join(d, "single_deploy_model.onnx"),
                 "graph flow": os.path.join(d, "graph_deploy_model.onnx")}
        for k, path in paths.items():
            ops = kernels(path, d)
            print(f"{k} ORT kernels: {ops.count('QLinearConv')} QLinearConv, {ops.count('Conv')} float Conv, "
                  f"{ops.count('QLinearAdd')} QLinearAdd, {ops.count('Add')} float Add")
        for n in (1, 16) if args.runs else ():
            t = bench(paths, np.ascontiguousarray(test[:n].numpy()), args.runs)
            print(f"deploy latency batch {n}: single-op {t['single-op']:.3f} ms, graph flow {t['graph flow']:.3f} ms "
                  f"(single-op / graph flow {t['single-op'] / t['graph flow']:.3f})")


if __name__ == "__main__":
    main()
