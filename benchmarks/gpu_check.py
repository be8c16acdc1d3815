"""openamct on a CUDA GPU: what the CPU test suite can only count, measured (docs/gpu.md).

One command, each section on its own (a failure is printed and the next section runs; the exit
status says whether any failed):

1. steps: a small CNN and a transformer block, each compressed (2:4 + INT8) on the device, then
   20 steady training steps against plain FP32 training of the same model under the same
   precision: fp32, bf16 autocast, and fp16 autocast with a GradScaler. Median step time and peak
   memory (``torch.cuda.max_memory_allocated``), both models and their ratio.
2. syncs: the host synchronisations of one steady step, counted by CUDA itself
   (``torch.cuda.set_sync_debug_mode("warn")``: one warning per synchronising call), next to
   the count of values read back (``aten._local_scalar_dense``, kernel-internal ones included,
   from the profiler). The CPU suite's bound: one, the bad-value guard's.
3. save and restore: save from the CUDA model (it stays on its device), restore onto a fresh
   CUDA model from the record and a checkpoint: identical outputs and state dict.
4. compile: ``torch.compile`` (inductor) of the returned model: graph breaks, the first
   (compiling) step's time, then the compiled steady step against the eager one.
5. DDP with NCCL over every GPU, only with two or more (world size 1 would prove nothing).

Usage: ``python benchmarks/gpu_check.py [--steps 20] [--skip compile,ddp]``; about 5 minutes
on one H100. ``--device cpu`` runs the same sections on the CPU (no memory figures, no sync
debug mode, no DDP): the test suite runs it that way so the script is known to work before a
GPU meets it. Without CUDA and without ``--device cpu`` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import openamct as amct  # noqa: E402

CFG = ("retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
       "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 0 } } }\n")
PRECISIONS = ("fp32", "bf16", "fp16+scaler")


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.c3, self.b3 = nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        x = torch.relu(self.b3(self.c3(x)))
        return self.fc(x.mean((2, 3)))


class Block(nn.Module):
    """Embedding projection, LayerNorm, a residual GELU MLP, a head (token mean)."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.inp, self.ln = nn.Linear(64, d), nn.LayerNorm(d)
        self.up, self.down, self.head = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Linear(d, 8)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.down(nn.functional.gelu(self.up(self.ln(h))))
        return self.head(h.mean(1))


MODELS = {"cnn": (CNN, (32, 3, 32, 32)), "transformer": (Block, (32, 64, 64))}
QUICK = {"cnn": (4, 3, 8, 8), "transformer": (4, 8, 64)}  # --quick: the test suite's shapes


class Trainer:
    """One model's training step at one precision: fp32, bf16 autocast, or fp16 autocast with a
    gradient scaler (what mixed-precision training on a GPU uses)."""

    def __init__(self, model: nn.Module, device: str, precision: str) -> None:
        self.model, self.device, self.precision = model, device, precision
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.dtype = {"bf16": torch.bfloat16, "fp16+scaler": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(device) if precision == "fp16+scaler" else None

    def step(self, x):
        with torch.autocast(self.device, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            out = self.model(x)
        loss = out.float().square().mean()
        if self.scaler is None:
            loss.backward()
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return loss


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(trainer: Trainer, x, steps: int) -> tuple[float, float | None]:
    """(median step ms, peak memory MB of the steps) after two warm-up steps."""
    dev = trainer.device
    for _ in range(2):
        trainer.step(x)
    _sync(dev)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        trainer.step(x)
        _sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else None
    return statistics.median(times), peak


@dataclass(frozen=True)
class Run:
    device: str
    folder: str
    steps: int
    quick: bool

    def shape(self, kind: str) -> tuple[int, ...]:
        return QUICK[kind] if self.quick else MODELS[kind][1]


def _created(kind: str, run: Run):
    device, folder = run.device, run.folder
    make, shape = MODELS[kind][0], run.shape(kind)
    torch.manual_seed(0)
    x = torch.randn(*shape, device=device)
    cfg = os.path.join(folder, f"{kind}.cfg")
    with open(cfg, "w") as f:
        f.write(CFG)
    record = os.path.join(folder, f"{kind}_record.txt")
    model = amct.create_compressed_retrain_model(make().to(device), x, cfg, record).train()
    trainer = Trainer(model, device, "fp32")
    for _ in range(2):  # clips and 2:4 masks initialised
        trainer.step(x)
    return model, x, cfg, record


def section_steps(kind: str, run: Run) -> None:
    device, steps = run.device, run.steps
    model, x, _, _ = _created(kind, run)
    bad = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type != device]
    assert not bad, f"tensors left off the {device}: {bad[:4]}"
    for precision in PRECISIONS:
        plain = MODELS[kind][0]().to(device).train()
        ours_ms, ours_mb = _timed(Trainer(model, device, precision), x, steps)
        ref_ms, ref_mb = _timed(Trainer(plain, device, precision), x, steps)
        mem = "" if ours_mb is None else f"; peak memory {ours_mb:.0f} MB vs {ref_mb:.0f} MB ({ours_mb / ref_mb:.2f}x)"
        print(f"  {kind} {precision}: step {ours_ms:.2f} ms vs plain {ref_ms:.2f} ms ({ours_ms / ref_ms:.2f}x){mem}")


def section_syncs(kind: str, run: Run) -> None:
    device = run.device
    model, x, _, _ = _created(kind, run)
    trainer = Trainer(model, device, "fp32")
    trainer.step(x)
    _sync(device)
    syncs = None
    if device == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.step(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(x)
        _sync(device)
    reads = sum(e.name == "aten::_local_scalar_dense" for e in prof.events())
    counted = "n/a on the CPU" if syncs is None else str(syncs)
    print(f"  {kind}: one steady step: {counted} synchronising CUDA calls, {reads} values read back "
          "(bound: 1, the bad-value guard's)")
    assert syncs is None or syncs <= 1, f"{syncs} synchronisations in a steady step"
    assert reads <= 1, f"{reads} values read back in a steady step"


def section_save_restore(kind: str, run: Run) -> None:
    device, folder = run.device, run.folder
    model, x, cfg, record = _created(kind, run)
    model.eval()
    with torch.no_grad():
        model(x)  # the first eval forward writes the record's scales
    pth = os.path.join(folder, f"{kind}.pth")
    torch.save({"state_dict": model.state_dict()}, pth)
    t = time.perf_counter()
    amct.save_compressed_retrain_model(model, record, os.path.join(folder, kind), x)
    assert all(p.device.type == device for p in model.parameters()), "save moved the model"
    print(f"  {kind}: save from a {device} model: {time.perf_counter() - t:.1f} s")
    restored = amct.restore_compressed_retrain_model(MODELS[kind][0]().to(device), x, cfg, record, pth,
                                                     "state_dict").eval()
    with torch.no_grad():
        assert torch.equal(model(x), restored(x)), "restored outputs differ"
    a, b = model.state_dict(), restored.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "restored state differs"
    print(f"  {kind}: restore onto a {device} model: identical outputs and state dict")


def section_compile(kind: str, run: Run) -> None:
    device, steps = run.device, run.steps
    model, x, _, _ = _created(kind, run)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda inp: model(inp).square().mean())(x)
    print(f"  {kind}: training forward: {explained.graph_count} graph(s), {explained.graph_break_count} break(s)")
    for reason in sorted({str(r.reason).splitlines()[0][:120] for r in explained.break_reasons}):
        print(f"      {reason}")
    torch._dynamo.reset()
    compiled = Trainer(torch.compile(model), device, "fp32")
    t = time.perf_counter()
    compiled.step(x)
    _sync(device)
    first = time.perf_counter() - t
    fast, _ = _timed(compiled, x, steps)
    eager, _ = _timed(Trainer(model, device, "fp32"), x, steps)
    print(f"  {kind}: compiled: first step {first:.1f} s, then {fast:.2f} ms vs eager {eager:.2f} ms "
          f"({fast / eager:.2f}x)")


def _ddp_worker(rank: int, world: int, folder: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    try:
        torch.manual_seed(0)
        x = torch.randn(16, 3, 32, 32, device="cuda") + rank
        cfg = os.path.join(folder, "ddp.cfg")
        model = amct.create_compressed_retrain_model(CNN().cuda(), x, cfg, os.path.join(folder, "ddp_record.txt"))
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        trainer = Trainer(ddp, "cuda", "fp32")
        for _ in range(5):
            trainer.step(x)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        assert all(torch.equal(everyone[0], f) for f in everyone), "DDP ranks' parameters differ"
        if rank == 0:
            print(f"  DDP (nccl, world size {world}): 5 steps, parameters identical on every rank")
        del ddp, trainer, model
    finally:
        dist.destroy_process_group()


def section_ddp(run: Run) -> None:
    device, folder = run.device, run.folder
    count = torch.cuda.device_count() if device == "cuda" else 0
    if count < 2:
        print(f"  DDP: not run: {count} GPU(s); world size 1 would prove nothing about NCCL")
        return
    if not dist.is_nccl_available():
        print("  DDP: not run: this torch has no NCCL")
        return
    with open(os.path.join(folder, "ddp.cfg"), "w") as f:
        f.write(CFG)
    torch.multiprocessing.spawn(_ddp_worker, args=(count, folder, 29571), nprocs=count, join=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--skip", default="", help="sections not to run, comma-separated "
                        "(steps, syncs, save, compile, ddp)")
    parser.add_argument("--quick", action="store_true", help="tiny batches (a check that the script runs)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check "
              "(--device cpu runs the sections on the CPU)")
        return 0
    dev = args.device
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "CPU"
    count = torch.cuda.device_count() if dev == "cuda" else 1
    print(f"device: {name} x{count}, torch {torch.__version__}")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    failed = []
    with tempfile.TemporaryDirectory(prefix="openamct-gpu-") as folder:
        run = Run(dev, folder, args.steps, args.quick)
        sections = [(f"{title} {k}", key, lambda fn=fn, k=k: fn(k, run)) for title, key, fn in (
            ("steps", "steps", section_steps), ("syncs", "syncs", section_syncs),
            ("save/restore", "save", section_save_restore), ("compile", "compile", section_compile)) for k in MODELS]
        sections.append(("ddp", "ddp", lambda: section_ddp(run)))
        for title, key, section in sections:
            if key in skip:
                continue
            print(f"[{title}]", flush=True)
            t = time.perf_counter()
            try:
                section()
            except Exception:  # noqa: BLE001 - each section reports its own failure, the rest still run
                failed.append(title)
                print("  FAILED:\n" + "".join("    " + line for line in traceback.format_exc().splitlines(True)))
            print(f"  ({time.perf_counter() - t:.1f} s)", flush=True)
    print("gpu_check: " + (f"{len(failed)} section(s) failed: {', '.join(failed)}" if failed else "all sections passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
