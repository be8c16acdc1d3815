"""Training-step cost of 2:4 sparsity (NMSparsifier) vs the dense model.

One step = forward + backward + SGD step. Variants, run interleaved round by round so drift
in machine speed hits all of them alike; the figure is the median step time:
  dense        the plain model
  nm0          every eligible Conv2d/Linear wrapped, update_freq 0 (mask fixed after batch 1)
  nm1          same, update_freq 1 (mask recomputed every step)
  nm0-detach   update_freq 0 but with the ``w + (w*mask - w).detach()`` straight-through trick
               instead of NMSparsifier's autograd Function (the alternative it was chosen over)
Models: a small ResNet-style CNN (batch 16, 3x64x64) and a 6-layer 768/3072 MLP (8x128 tokens).

    .venv/bin/python benchmarks/nm_overhead.py [--rounds 12] [--steps 3] [--models cnn,mlp]
        [--threads 2] [--clock wall|cpu] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.* importable

from benchmarks.models import BasicBlock  # noqa: E402
from openamct.sparsity.nm import NMSparsifier, compute_nm_mask, nm_eligible  # noqa: E402


def block(cin: int, cout: int, stride: int) -> BasicBlock:
    """A torchvision BasicBlock, with a 1x1 conv + BN shortcut where the shape changes."""
    down = None
    if stride != 1 or cin != cout:
        down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
    return BasicBlock(cin, cout, stride, down)


class SmallResNet(nn.Module):
    """ResNet-18 layout at half width (32..256 channels), 3x3 stride-1 stem."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32),
                                  nn.ReLU())
        layers, cin = [], 32
        for i, cout in enumerate((32, 64, 128, 256)):
            layers += [block(cin, cout, 1 if i == 0 else 2), block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(256, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def make_mlp() -> nn.Module:
    blocks = []
    for _ in range(3):
        blocks += [nn.Linear(768, 3072), nn.GELU(), nn.Linear(3072, 768), nn.GELU()]
    return nn.Sequential(*blocks)


class Sparse(nn.Module):
    """Runs the wrapped layer with ``sparsifier(weight)`` in place of its weight."""

    def __init__(self, layer: nn.Module, update_freq: int, detach_trick: bool) -> None:
        super().__init__()
        self.layer = layer
        self.sparsifier = NMSparsifier.from_module(layer, update_freq)
        self.detach_trick = detach_trick

    def forward(self, x):
        w = self.layer.weight
        if self.detach_trick:
            w = w + (self.sparsifier(w.detach()) - w).detach()
        else:
            w = self.sparsifier(w)
        if isinstance(self.layer, nn.Linear):
            return F.linear(x, w, self.layer.bias)
        return self.layer._conv_forward(x, w, self.layer.bias)


def sparsify(model: nn.Module, update_freq: int, detach_trick: bool = False) -> int:
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, (nn.Conv2d, nn.Linear)) and nm_eligible(child)[0]:
            setattr(model, name, Sparse(child, update_freq, detach_trick))
            count += 1
        else:
            count += sparsify(child, update_freq, detach_trick)
    return count


def bench(name: str, base: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_fn,
          rounds: int, steps: int, device: torch.device, clock) -> None:
    variants = {"dense": copy.deepcopy(base)}
    for label, freq, trick in (("nm0", 0, False), ("nm1", 1, False), ("nm0-detach", 0, True)):
        model = copy.deepcopy(base)
        wrapped = sparsify(model, freq, trick)
        variants[label] = model
    optims = {k: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
              for k, m in variants.items()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(label: str) -> float:
        model, opt = variants[label], optims[label]
        sync()
        t0 = clock()
        loss = loss_fn(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        return clock() - t0

    for label in variants:  # warm-up; also computes the first masks
        model = variants[label].train()
        for _ in range(2):
            step(label)
    times: dict[str, list[float]] = {k: [] for k in variants}
    labels = list(variants)
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:  # rotate the order
            times[label] += [step(label) for _ in range(steps)]
    dense = statistics.median(times["dense"])
    print(f"\n{name}: {wrapped} sparsified layers, {rounds}x{steps} steps per variant, "
          f"{torch.get_num_threads()} threads, {device}")
    for label, ts in times.items():
        med = statistics.median(ts)
        # Step i of a variant vs step i of dense ran seconds apart: on a shared machine the
        # median of these paired ratios is steadier than the ratio of the medians.
        paired = statistics.median(t / d for t, d in zip(ts, times["dense"], strict=True))
        print(f"  {label:11s} median {med * 1e3:8.2f} ms   ratio {med / dense:5.3f}x   "
              f"paired {paired:5.3f}x")


def mask_cost(device: torch.device, clock) -> None:
    for shape, axis in (((3072, 768), 1), ((256, 256, 3, 3), 1), ((4096, 4096), 1)):
        w = torch.randn(shape, device=device)
        compute_nm_mask(w, axis)
        reps = 5
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(reps):
            compute_nm_mask(w, axis)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (clock() - t0) / reps
        print(f"  compute_nm_mask {list(shape)} ({w.numel() / 1e6:.1f} M): {dt * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu = process CPU time: robust to other processes on a shared "
                             "machine when --threads 1 (with 2 threads it counts spin-waits)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"clock: {args.clock}")
    print("mask computation cost:")
    mask_cost(device, clock)
    if "cnn" in args.models:
        x = torch.randn(16, 3, 64, 64, device=device)
        y = torch.randint(0, 10, (16,), device=device)
        bench("SmallResNet (batch 16, 3x64x64)", SmallResNet().to(device), x, y,
              F.cross_entropy, args.rounds, args.steps, device, clock)
    if "mlp" in args.models:
        x = torch.randn(8, 128, 768, device=device)
        bench("MLP 6x Linear 768/3072 (8x128 tokens)", make_mlp().to(device), x,
              torch.randn(8, 128, 768, device=device), F.mse_loss, args.rounds, args.steps,
              device, clock)


if __name__ == "__main__":
    main()
