"""auto_channel_prune_search on our ResNet-18 layout (random weights, 1x3x224x224 per sample):
search time with the MACs budget, and the latency budget's measured ONNX Runtime speed-up
against the one asked for and against the MACs-budget config's.

Every speed-up here is measured independently of the search: the found config goes through
``create_prune_retrain_model`` + ``save_prune_retrain_model`` and the deploy file is timed in
ONNX Runtime (2 intra-op threads) interleaved with the FP32 export, median of --runs.

Usage: python benchmarks/prune_search.py [--ratio 2] [--runs 40] [--only macs,latency]
Timings are from a shared 2-core machine; ratios are interleaved.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import openamct as amct  # noqa: E402
from benchmarks.models import resnet18  # noqa: E402
from openamct.export.ort_session import latency_ms, session  # noqa: E402
from openamct.export.writer import export_onnx, write_onnx  # noqa: E402
from openamct.search.report import format_search_report  # noqa: E402
from openamct.stats import count_macs  # noqa: E402


def measured_speedup(model, cfg: str, x: torch.Tensor, folder: str, runs: int) -> tuple[float, float, float]:
    pruned = amct.create_prune_retrain_model(model, x, cfg, os.path.join(folder, "rec.txt"))
    amct.save_prune_retrain_model(pruned, os.path.join(folder, "p"), x)
    fp32 = os.path.join(folder, "fp32.onnx")
    if not os.path.exists(fp32):
        write_onnx(export_onnx(model.eval(), x), fp32)
    lat = latency_ms({"fp32": session(fp32), "pruned": session(os.path.join(folder, "p_deploy_model.onnx"))},
                     x.numpy(), runs=runs)
    return lat["fp32"] / lat["pruned"], count_macs(model, x) / count_macs(pruned, x), lat["fp32"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ratio", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--only", default="macs,latency")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    model = resnet18().eval()
    g = torch.Generator().manual_seed(0)
    data = [[torch.randn(8, 3, 224, 224, generator=g), torch.randint(0, 1000, (8,), generator=g)]]
    x = data[0][0][:1]
    with tempfile.TemporaryDirectory() as folder:
        cfg = os.path.join(folder, "search.cfg")
        with open(cfg, "w") as f:
            f.write(f"compress_ratio: {args.ratio}\n")
        results = {}
        for budget in args.only.split(","):
            out = os.path.join(folder, f"found_{budget}.cfg")
            t = time.perf_counter()
            report = amct.auto_channel_prune_search(model, cfg, data, out, budget=budget)
            took = time.perf_counter() - t
            print(f"\n== budget={budget}, compress_ratio {args.ratio:g}: search took {took:.1f} s")
            print(format_search_report(report))
            speed, macs, fp32_ms = measured_speedup(model, out, x, folder, args.runs)
            results[budget] = (took, speed, macs)
            print(f"measured: {speed:.2f}x faster in ORT (FP32 {fp32_ms:.1f} ms), {macs:.2f}x fewer MACs "
                  f"(whole model)")
        print("\nsummary (shared 2-core machine):")
        for budget, (took, speed, macs) in results.items():
            err = 100 * (speed / args.ratio - 1)
            print(f"  {budget:8s} search {took:5.1f} s | ORT speed-up {speed:.2f}x ({err:+.0f} % vs {args.ratio:g}x asked"
                  f"{' as latency' if budget == 'latency' else ''}) | MACs {macs:.2f}x fewer")


if __name__ == "__main__":
    main()
