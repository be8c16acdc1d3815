"""Deploy speed of ``quantize_activation_matmul`` on torchvision Swin-T (224x224, batch 1, random
weights): openamct's deploy model with the switch on and off against ``quantize_static``'s
(benchmarks/deploy_speed.quantize_static: QDQ, uint8 activations, per-channel int8 weights,
MinMax on the same batches) and the FP32 export, each ORT session on 2 intra-op threads with
``session.intra_op.allow_spinning=0`` (``openamct.export.ort_session``), timed in interleaved
rounds and repeated with fresh sessions; the ratios are paired within a repeat. It also prints
each file's cosine to the FP32 model on one input and the float ops left in ORT's optimised
graph (which MatMul kernels ORT chose).

Measured (ORT 1.32, AMD EPYC 2 cores shared with other jobs, load ~15, so single ratios swing;
median of 5 paired repeats), since torchvision's F.linear qkv / proj are routed to their quantized
layers (compressed/functional.py): fp32 325 ms, quantize_static 172, switch off 214, switch on
150: on/off 0.702 (0.70-0.85), on/quantize_static 0.893 (0.86-1.01), off/quantize_static 1.26.
Cosine to FP32: quantize_static 0.99922, off 0.99964, on 0.99961. ORT's graph with the switch on:
no float MatMul or Gemm (49 QGemm: qkv, proj, the MLPs, the head; 12 QLinearMatMul; 15
MatMulIntegerToFloat: q @ k^T and the patch merging reductions; 1 QLinearConv). Before that routing (the 24 qkv / proj left as float Gemm) the same
benchmark measured on/quantize_static 1.105 and off/quantize_static 1.48.

Usage: PYTHONPATH=. python benchmarks/attention_matmul_speed.py [--runs 20] [--repeat 3] [--calib 4]
       [--keep DIR]   (DIR keeps the four ONNX files; a second run with the same DIR only times them)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.deploy_speed import export_fp32, quantize_static  # noqa: E402
from benchmarks.zoo_speed import cosine, float_ops, openamct_files  # noqa: E402
from openamct.export.ort_session import latency_ms, session  # noqa: E402
from tests.zoo.torchvision_ops import vision_modules  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--calib", type=int, default=4)
    p.add_argument("--keep", default=None, help="folder for the ONNX files, reused when they are there")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(2)
    tv, _ = vision_modules()
    torch.manual_seed(0)
    model = tv.models.swin_t(weights=None).eval()
    g = torch.Generator().manual_seed(1)
    shape = (1, 3, 224, 224)
    calib = [torch.randn(shape, generator=g) for _ in range(args.calib)]
    x = torch.randn(shape, generator=g).numpy()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        os.makedirs(tmp, exist_ok=True)
        paths = {"fp32": os.path.join(tmp, "fp32.onnx"), "quantize_static": os.path.join(tmp, "qs.onnx"),
                 "matmul off": os.path.join(tmp, "off_deploy_model.onnx"),
                 "matmul on": os.path.join(tmp, "on_deploy_model.onnx")}
        if not all(os.path.exists(v) for v in paths.values()):
            export_fp32(model, calib[0], paths["fp32"])
            quantize_static(paths["fp32"], paths["quantize_static"], calib)
            openamct_files(model, calib, tmp, "off")
            openamct_files(model, calib, tmp, "on", matmul=True)
        reps = []
        for _ in range(args.repeat):
            sessions = {k: session(v) for k, v in paths.items()}
            reps.append(latency_ms(sessions, x, runs=args.runs, min_s=2.0))
        med = {k: float(np.median([r[k] for r in reps])) for k in paths}
        print("swin_t 224x224 b1 (ms, median of repeats): " + " | ".join(f"{k} {v:.2f}" for k, v in med.items()))
        for a, b in (("matmul on", "matmul off"), ("matmul on", "quantize_static"), ("matmul off", "quantize_static")):
            ratios = sorted(r[a] / r[b] for r in reps)
            print(f"  {a}/{b}: {np.median(ratios):.3f} (paired: {', '.join(f'{v:.3f}' for v in ratios)})")
        ref = sessions["fp32"].run(None, {"x": x})[0]
        for k in paths:
            if k != "fp32":
                print(f"  {k}: cosine to FP32 {cosine(sessions[k].run(None, {'x': x})[0], ref):.5f}; "
                      f"float ops: {float_ops(paths[k])}")


if __name__ == "__main__":
    main()
