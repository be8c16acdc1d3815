"""The CNN pruning domain's reach on torchvision ResNet-18 and ResNet-50 (random weights): the
share of parameters and MACs a cut of ``r`` of every unit's channels removes (and on MobileNetV2
and DenseNet-121, for depthwise chains and concats), with upstream's
rules (``CnnDomain(upstream_rules=True)``: no conv feeding a residual add, no concat consumer,
no grouped or depthwise conv) against openamct's coupled groups, side by side in one run.

Every criterion cuts ``round(r · size)`` channels of each unit, so the shares do not depend on
it: the script cuts by ``variance`` (the ``CNN_VARIANCE_PRUNE_CFG`` / ``CNN_RECONSTRUCT_PRUNE_CFG``
ranking), ``l1`` and ``l2`` and checks that all three remove the same count. MACs are counted on
a 64x64 input (every conv's share is the same at 224x224; only the classifier's weight differs).
About a minute and a half for the two ResNets on two shared CPU cores (the default);
MobileNetV2 and DenseNet-121 take a few minutes more. ``--quality`` adds, for the first model,
the held-out output error of each recovery (random weights: a check that recovery helps, not an
accuracy figure).

    python benchmarks/prune_cnn_reach.py [--ratios 0.3 0.5] [--models resnet18 resnet50 mobilenet_v2 densenet121] [--quality]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openamct.pruning.domains.cnn import CnnDomain  # noqa: E402
from tests.zoo.torchvision_ops import vision_modules  # noqa: E402

SIZE = 64
CRITERIA = ("variance", "l1", "l2")
# ResNets: residual adds; MobileNetV2: depthwise chains and residual adds; DenseNet: concats
MODELS = ("resnet18", "resnet50", "mobilenet_v2", "densenet121")


def macs(model: nn.Module, x: torch.Tensor) -> int:
    """Multiply-accumulates of every conv and linear call on ``x``."""
    total = [0]

    def hook(m, args, out):
        if isinstance(m, nn.Conv2d):
            total[0] += out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)
        else:
            total[0] += out.numel() * m.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return total[0]


def keep_masks(units, scores, ratio: float) -> dict[str, torch.Tensor]:
    """The best ``1 - ratio`` of each unit, equal in every block of a grouped unit."""
    out = {}
    for u in units:
        blocks = u.extra["prune_group"]
        blk = u.size // blocks
        mask = torch.zeros(u.size, dtype=torch.bool)
        for b in range(blocks):
            best = scores[u.name][b * blk:(b + 1) * blk].argsort(descending=True)[:blk - round(blk * ratio)]
            mask[b * blk + best] = True
        out[u.name] = mask
    return out


def measure(model: nn.Module, upstream: bool, ratios: list[float], data: list[torch.Tensor]) -> dict[float, dict]:
    """Per ratio: units, the share of conv channels in them, and the parameters / MACs removed."""
    params0, macs0 = sum(p.numel() for p in model.parameters()), macs(model, data[0])
    conv_channels = sum(m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d))
    domain = CnnDomain(upstream_rules=upstream)
    units = domain.units(model, data[0])  # once: apply works on copies of the model it ran on
    scores = {c: domain.scores(model, units, data, c) for c in CRITERIA}
    out = {}
    for r in ratios:
        removed = {}
        for criterion in CRITERIA:
            net = copy.deepcopy(model)
            domain.apply(net, keep_masks(units, scores[criterion], r), data, reconstruct=False)
            removed[criterion] = (params0 - sum(p.numel() for p in net.parameters()), macs0 - macs(net, data[0]))
        if len(set(removed.values())) != 1:
            raise AssertionError(f"criteria removed different counts: {removed}")
        p, m = removed["variance"]
        out[r] = {"units": len(units), "channels": sum(u.size for u in units) / conv_channels,
                  "params": p / params0, "macs": m / macs0}
    return out


def quality(model: nn.Module, ratios: list[float], data: list[torch.Tensor], held_out: list[torch.Tensor]) -> None:
    """Held-out relative output error against the unpruned model, openamct's groups, for each
    criterion and recovery (none: the masked trial's function; bias: the cut channels' mean folded
    into the consumer's bias or the BatchNorm after it; ls: least squares)."""
    with torch.no_grad():
        want = [model(x) for x in held_out]
    domain = CnnDomain()
    units = domain.units(model, data[0])
    print("\n| r | criterion | error, no recovery | error, bias | error, least squares | least squares / none |")
    print("|---|---|---|---|---|---|")
    for r in ratios:
        for criterion in ("variance", "l2"):
            keep = keep_masks(units, domain.scores(model, units, data, criterion), r)
            errs = []
            for recovery in ("none", "bias", "ls"):
                net = copy.deepcopy(model)
                domain.options = {"recovery": recovery}
                domain.apply(net, keep, data, reconstruct=recovery != "none")
                with torch.no_grad():
                    errs.append(sum(float((net(x) - w).norm() / w.norm()) for x, w in zip(held_out, want))
                                / len(want))
            print(f"| {r:g} | {criterion} | {errs[0]:.3f} | {errs[1]:.3f} | {errs[2]:.3f} | {errs[2] / errs[0]:.2f} |",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5])
    parser.add_argument("--models", nargs="+", default=list(MODELS[:2]), choices=MODELS)
    parser.add_argument("--quality", action="store_true",
                        help="also the held-out output error of each recovery on the first model")
    args = parser.parse_args()
    torchvision, _ = vision_modules()
    torch.manual_seed(0)
    print("| model | r | units (upstream / openamct) | conv channels in units | params removed upstream "
          "| params removed openamct | ratio | MACs removed upstream | MACs removed openamct | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    first = None
    for name in args.models:
        model = getattr(torchvision.models, name)()
        model.train()
        with torch.no_grad():  # BatchNorm statistics of an input distribution, for the variance criterion
            model(torch.randn(8, 3, SIZE, SIZE))
        model.eval()
        data = [torch.randn(4, 3, SIZE, SIZE) for _ in range(2)]
        ups, ourss = measure(model, True, args.ratios, data), measure(model, False, args.ratios, data)
        for r in args.ratios:
            up, ours = ups[r], ourss[r]
            print(f"| {name} | {r:g} | {up['units']} / {ours['units']} | {up['channels']:.0%} / {ours['channels']:.0%} "
                  f"| {up['params']:.1%} | {ours['params']:.1%} | {ours['params'] / up['params']:.2f}x "
                  f"| {up['macs']:.1%} | {ours['macs']:.1%} | {ours['macs'] / up['macs']:.2f}x |", flush=True)
        first = first if name != args.models[0] else model
    if args.quality:
        quality(first, args.ratios, [torch.randn(8, 3, SIZE, SIZE) for _ in range(4)],
                [torch.randn(8, 3, SIZE, SIZE) for _ in range(2)])
    print(f"\nshares identical for criteria {', '.join(CRITERIA)} (checked); input {SIZE}x{SIZE}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")


if __name__ == "__main__":
    main()
