"""Cost of one QAT training step: FP32 vs openamct vs torch.ao.quantization (prepare_qat).

Model: ResNet-18 layout (BasicBlock x [2, 2, 2, 2], widths 64-512, 1000 classes), batch 16,
3x64x64, 2 threads, SGD (forward + backward + step). Two stems: ImageNet (7x7/2 + max-pool) and
CIFAR (3x3/1, no pool).

- fp32: the float model.
- openamct: every conv and the fc wrapped in CompressedLayer, BN folded, ActULQ on each layer's
  input (clips initialised on one batch; fixed_min after ReLU; a block's conv1 and its
  downsample share one quantizer), ARQ per-channel weights.
- torch.ao: fuse conv-bn(-relu) with fuse_modules_qat, prepare_qat with the fbgemm QAT qconfig
  (fake quant on every fused module's output and weights; the residual add is not observed).

Times: the three variants run interleaved in one process (round-robin, order rotated), median of
``--steps`` steps after warm-up, as wall time and as process CPU time (all threads). On a shared
machine the wall time of a multi-threaded step is inflated by every parallel region that waits for
a descheduled worker thread, so the load average is printed with the results; CPU time is less
sensitive to that. Memory: each variant runs alone in a fresh subprocess; we report
the process's peak RSS (VmHWM) and its growth over the RSS measured just before the first
training step (model, data and clip init already in memory). It measures whole-process memory
(allocator caching included), not tensor bytes.

Eval: the forward of the training model in eval mode under ``torch.no_grad()`` (what a
validation pass runs), against the float model's, interleaved the same way. openamct keeps each
layer's folded, quantized weight between eval forwards, so only the activations are quantized.

Usage: python benchmarks/qat_overhead.py [--steps 15] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from openamct.compressed.layer import CompressedLayer  # noqa: E402
from openamct.quant.quantizers import ActULQ, WeightARQ  # noqa: E402

THREADS, BATCH, RES, CLASSES = 2, 16, 64, 1000


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        idt = x if self.downsample is None else self.downsample(x)
        return self.relu2(out + idt)


class ResNet18(nn.Module):
    def __init__(self, stem: str = "imagenet", num_classes: int = CLASSES) -> None:
        super().__init__()
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        else:
            self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        layers, cin = [], 64
        for i, cout in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def to_openamct(model: ResNet18, init_batch: torch.Tensor) -> nn.Module:
    def wrap(conv, bn, aq):
        return CompressedLayer.wrap(conv, bn=bn, act_quant=aq, wts_quant=WeightARQ(True))

    model.conv1 = wrap(model.conv1, model.bn1, ActULQ(fixed_min=False))
    model.bn1 = nn.Identity()
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for blk in layer:
            shared = ActULQ(fixed_min=True)  # conv1 and downsample read the same tensor
            blk.conv1, blk.bn1 = wrap(blk.conv1, blk.bn1, shared), nn.Identity()
            blk.conv2, blk.bn2 = wrap(blk.conv2, blk.bn2, ActULQ(fixed_min=True)), nn.Identity()
            if blk.downsample is not None:
                blk.downsample = nn.Sequential(wrap(blk.downsample[0], blk.downsample[1], shared))
    model.fc = CompressedLayer.wrap(model.fc, act_quant=ActULQ(fixed_min=True),
                                    wts_quant=WeightARQ(False))
    model.train()
    with torch.no_grad():
        model(init_batch)  # initialises every ActULQ's clips (upstream: first batch)
    return model


def to_torch_ao(model: ResNet18) -> nn.Module:
    import torch.ao.quantization as tq

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    model.train()
    tq.fuse_modules_qat(model, [["conv1", "bn1", "relu"]], inplace=True)
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for blk in layer:
            tq.fuse_modules_qat(blk, [["conv1", "bn1", "relu1"], ["conv2", "bn2"]], inplace=True)
            if blk.downsample is not None:
                tq.fuse_modules_qat(blk.downsample, [["0", "1"]], inplace=True)
    wrapped = nn.Sequential(tq.QuantStub(), model, tq.DeQuantStub())
    wrapped.qconfig = tq.get_default_qat_qconfig("fbgemm")
    return tq.prepare_qat(wrapped.train(), inplace=False)


def build(variant: str, stem: str, seed: int = 0):
    torch.manual_seed(seed)
    model = ResNet18(stem)
    x = torch.randn(BATCH, 3, RES, RES)
    y = torch.randint(0, CLASSES, (BATCH,))
    if variant == "openamct":
        model = to_openamct(model, x)
    elif variant == "torch.ao":
        model = to_torch_ao(model)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    return model, step


def _status_kb(field: str) -> int:
    # VmHWM is this address space's peak RSS; ru_maxrss is not usable here because Linux keeps
    # the parent's peak across fork + exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(variant: str, stem: str) -> None:
    torch.set_num_threads(THREADS)
    _, step = build(variant, stem)
    before = _status_kb("VmRSS")
    for _ in range(5):
        step()
    peak = _status_kb("VmHWM")
    print(json.dumps({"peak_kb": peak, "growth_kb": peak - before}))


def measure_memory(variant: str, stem: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--mem-child", variant,
                          "--stem", stem], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_interleaved(stem: str, steps: int, warmup: int) -> dict[str, tuple[float, float]]:
    """Median (wall seconds, process CPU seconds) per step for each variant."""
    variants = ["fp32", "openamct", "torch.ao"]
    fns = {v: build(v, stem)[1] for v in variants}
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for i in range(warmup + steps):
        order = variants[i % 3:] + variants[:i % 3]
        for v in order:
            t0, c0 = time.perf_counter(), time.process_time()
            fns[v]()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if i >= warmup:
                times[v].append((dt, dc))
    return {v: (statistics.median(t for t, _ in ts), statistics.median(c for _, c in ts))
            for v, ts in times.items()}


def time_eval_interleaved(stem: str, steps: int, warmup: int) -> dict[str, float]:
    """Median wall seconds of an eval-mode forward under no_grad, per variant."""
    variants = ["fp32", "openamct"]
    runs = {}
    for v in variants:
        model, step = build(v, stem)
        step()  # one training step first: the eval pass follows training, as in a real run
        model.eval()
        x = torch.randn(BATCH, 3, RES, RES)
        runs[v] = (model, x)
    times: dict[str, list[float]] = {v: [] for v in variants}
    with torch.no_grad():
        for i in range(warmup + steps):
            for v in (variants if i % 2 == 0 else variants[::-1]):
                model, x = runs[v]
                t0 = time.perf_counter()
                model(x)
                if i >= warmup:
                    times[v].append(time.perf_counter() - t0)
    return {v: statistics.median(ts) for v, ts in times.items()}


def profile(stem: str) -> None:
    _, step = build("openamct", stem)
    for _ in range(3):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stem", choices=("imagenet", "cifar"), default=None)
    ap.add_argument("--profile", action="store_true", help="profile the openamct step instead")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--mem-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mem_child:
        memory_child(args.mem_child, args.stem or "imagenet")
        return
    torch.set_num_threads(args.threads)
    stems = [args.stem] if args.stem else ["imagenet", "cifar"]
    if args.profile:
        for stem in stems:
            profile(stem)
        return
    print(f"ResNet-18 layout, batch {BATCH}, 3x{RES}x{RES}, SGD step; "
          f"{args.threads} threads, median of {args.steps} interleaved steps after {args.warmup} warm-up")
    for stem in stems:
        med = time_interleaved(stem, args.steps, args.warmup)
        base, cbase = med["fp32"]
        print(f"\n[{stem} stem] step time (wall) and process CPU time per step "
              f"(load average {os.getloadavg()[0]:.1f})")
        for v, (t, c) in med.items():
            print(f"  {v:9s} wall {t * 1e3:8.1f} ms  {t / base:5.2f}x FP32   "
                  f"cpu {c * 1e3:8.1f} ms  {c / cbase:5.2f}x FP32")
        ev = time_eval_interleaved(stem, args.steps, args.warmup)
        print(f"[{stem} stem] eval forward under no_grad (wall, median, interleaved)")
        for v, t in ev.items():
            print(f"  {v:9s} wall {t * 1e3:8.1f} ms  {t / ev['fp32']:5.2f}x FP32")
        if not args.no_memory:
            mem = {v: measure_memory(v, stem) for v in med}
            print(f"[{stem} stem] peak RSS of a fresh process running 5 steps "
                  f"(growth = peak minus RSS before the first step)")
            for v, m in mem.items():
                print(f"  {v:9s} peak {m['peak_kb'] / 1024:7.1f} MiB ({m['peak_kb'] / mem['fp32']['peak_kb']:4.2f}x)"
                      f"   growth {m['growth_kb'] / 1024:7.1f} MiB "
                      f"({m['growth_kb'] / max(1, mem['fp32']['growth_kb']):4.2f}x)")


if __name__ == "__main__":
    main()
