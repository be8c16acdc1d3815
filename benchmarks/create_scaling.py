"""Graph capture + plan, and the whole create_*, for residual nets with 18, 66 and 258 conv layers.

Ours is measured side by side with the alternatives a tool could build on (torch.fx,
torch.export) in one run; upstream AMCT cannot be installed here, so its figures measured on
this machine are printed as reference constants.
Run: .venv/bin/python benchmarks/create_scaling.py
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import openamct as amct  # noqa: E402
from benchmarks.models import resnet_with_conv_layers  # noqa: E402
from openamct import pipeline  # noqa: E402

UPSTREAM_QUANT = {18: 0.2, 66: 0.9, 258: 5.8}  # s, create_compressed_retrain_model, quant-only config
UPSTREAM_PRUNE = {66: 0.96, 258: 10.8}  # s, with a filter-pruning config

QUANT_CFG = "retrain_data_quant_config { ulq_quantize { clip_max_min { clip_max: 6 clip_min: -6 } } }\n" \
            "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n"
PRUNE_CFG = "prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.3 ascend_optimized: false } } }\n"


def timed(fn, repeat=3):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    x = torch.randn(1, 3, 32, 32)
    folder = tempfile.mkdtemp()
    cfgs = {}
    for name, text in (("quant", QUANT_CFG), ("prune", PRUNE_CFG)):
        cfgs[name] = os.path.join(folder, f"{name}.cfg")
        with open(cfgs[name], "w") as f:
            f.write(text)
    rec = os.path.join(folder, "record.txt")
    print(f"{'conv layers':>11} {'capture+plan':>13} {'torch.fx':>9} {'torch.export':>13} "
          f"{'create quant':>13} {'upstream':>9} {'ratio':>6} {'create prune':>13} {'upstream':>9} {'ratio':>6}")
    rows = {}
    for n in (18, 66, 258):
        model = resnet_with_conv_layers(n).eval()
        model(x)  # warm up kernels once
        t_plan = timed(lambda m=model: pipeline.analyse(copy.deepcopy(m), x, cfgs["quant"], "compressed"))
        t_fx = timed(lambda m=model: torch.fx.symbolic_trace(m))
        t_export = timed(lambda m=model: torch.export.export(m, (x,), strict=False), repeat=1)
        t_quant = timed(lambda m=model: amct.create_compressed_retrain_model(m, x, cfgs["quant"], rec))
        t_prune = timed(lambda m=model: amct.create_compressed_retrain_model(m, x, cfgs["prune"], rec))
        rows[n] = (t_quant, t_prune)
        up_q, up_p = UPSTREAM_QUANT.get(n), UPSTREAM_PRUNE.get(n)
        ratio_q = f"{up_q / t_quant:5.1f}x" if up_q else "    -"
        ratio_p = f"{up_p / t_prune:5.1f}x" if up_p else "    -"
        print(f"{n:>11} {t_plan:>12.3f}s {t_fx:>8.3f}s {t_export:>12.3f}s {t_quant:>12.3f}s "
              f"{(f'{up_q:.2f}s' if up_q else '-'):>9} {ratio_q:>6} {t_prune:>12.3f}s "
              f"{(f'{up_p:.2f}s' if up_p else '-'):>9} {ratio_p:>6}")
    for label, idx in (("quant", 0), ("prune", 1)):
        per_layer = [rows[n][idx] / n for n in (18, 66, 258)]
        growth = (rows[258][idx] / rows[66][idx]) / (258 / 66)
        print(f"{label}: seconds per conv layer {', '.join(f'{p * 1000:.2f} ms' for p in per_layer)}; "
              f"66->258 growth relative to linear: {growth:.2f} (1.00 = linear)")
    print("ratio = upstream time / openamct time (higher is better; target >= 2 at 258 layers)")


if __name__ == "__main__":
    main()
