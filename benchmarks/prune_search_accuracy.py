"""auto_channel_prune_search vs uniform prune ratios on the demo's trained MnistNet, right after
pruning (no fine-tuning): test accuracy raw, and after re-estimating BatchNorm statistics on
1,024 training images (no weight update), with the MACs cut of each.

Raw accuracy right after pruning is near chance for every allocation at a 2x MACs cut: the
consumers' BNs hold statistics of inputs that included the removed channels. The BN-adapted
column is the one that tells allocations apart.

Usage: python benchmarks/prune_search_accuracy.py [--seed 0] [--ratio 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import openamct as amct  # noqa: E402
from openamct.demo.data import load_mnist_5k  # noqa: E402
from openamct.demo.models import MnistNet  # noqa: E402
from openamct.demo.train import evaluate, train_mnist  # noqa: E402
from openamct.stats import count_macs  # noqa: E402

UNIFORM = "prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: %s ascend_optimized: false } } }\n"


def bn_adapted(model, x_tr):
    """``model`` with its BatchNorm statistics re-estimated on 1,024 training images (no weight
    update), in eval mode."""
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    model.train()
    with torch.no_grad():
        for i in range(0, 1024, 64):
            model(x_tr[i:i + 64])
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratio", type=float, default=2.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    x_tr, y_tr, x_te, y_te = load_mnist_5k(seed=0)
    torch.manual_seed(args.seed)
    model = MnistNet()
    train_mnist(model, x_tr, y_tr, seed=args.seed, progress=False)
    model.eval()
    x, base = x_tr[:1], count_macs(model, x_tr[:1])
    print(f"FP32 test accuracy {100 * evaluate(model, x_te, y_te):.1f} %")
    with tempfile.TemporaryDirectory() as d:
        def row(label, cfg_text):
            cfg = os.path.join(d, "c.cfg")
            with open(cfg, "w") as f:
                f.write(cfg_text)
            p = amct.create_prune_retrain_model(model, x, cfg, os.path.join(d, f"{label}.txt"))
            raw = evaluate(p.eval(), x_te, y_te)
            print(f"| {label:14s} | {base / count_macs(p, x):.2f}x | {100 * raw:5.1f} % | "
                  f"{100 * evaluate(bn_adapted(p, x_tr), x_te, y_te):5.1f} % |")

        print("| allocation | MACs cut | raw | BN re-estimated |\n|---|---|---|---|")
        for r in (0.25, 0.28, 0.30, 0.32, 0.35):
            row(f"uniform {r:.2f}", UNIFORM % r)
        search = os.path.join(d, "search.cfg")
        with open(search, "w") as f:
            f.write(f"compress_ratio: {args.ratio}\ntest_iteration: 4\n")
        out = os.path.join(d, "found.cfg")
        amct.auto_channel_prune_search(model, search, [[x_tr[i * 64:(i + 1) * 64], y_tr[i * 64:(i + 1) * 64]]
                                                       for i in range(4)], out)
        with open(out) as f:
            row("searched", f.read())


if __name__ == "__main__":
    main()
