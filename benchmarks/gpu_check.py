"""openamct on a CUDA GPU: the checks the CPU test suite can only approximate (see docs/gpu.md).

On a small CNN (2:4 + INT8) and a small transformer block (2:4 + INT8), each created on "cuda":

1. 20 steady training steps in float32, then 20 under bf16 autocast: median step time against
   plain FP32 training of the same model (same optimizer, same batch), and the host syncs of
   one steady step (``aten._local_scalar_dense`` calls, counted with a TorchDispatchMode; the
   CPU suite's bound is at most 1).
2. save (the plain, non-streamed save path), then restore onto a fresh CUDA model from the
   record and a checkpoint: outputs and state dict must be identical (asserted).
3. ``torch.compile`` (inductor) of the returned model: one training step, graph breaks counted
   with ``torch._dynamo.explain``, its loss against the eager step's.
4. DistributedDataParallel with NCCL over every GPU present (world size = device count; 1 GPU
   runs world size 1): create, 5 steps, parameters equal on all ranks.

Without CUDA it says so and exits 0. Expected run time: under 5 minutes on one GPU (compile
dominates). Usage: ``python benchmarks/gpu_check.py [--steps 20]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import openamct as amct

CFG = ("retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
       "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 0 } } }\n")


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


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _step(model, x, opt, amp: bool):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        out = model(x)
    loss = out.float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _median_ms(model, x, steps: int, amp: bool) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    _step(model, x, opt, amp)
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        _step(model, x, opt, amp)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _created(kind: str, folder: str):
    make, shape = MODELS[kind]
    torch.manual_seed(0)
    base = make().cuda()
    x = torch.randn(*shape, device="cuda")
    cfg = os.path.join(folder, f"{kind}.cfg")
    with open(cfg, "w") as f:
        f.write(CFG)
    record = os.path.join(folder, f"{kind}_record.txt")
    model = amct.create_compressed_retrain_model(base, x, cfg, record)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):  # clips and 2:4 masks initialised
        _step(model, x, opt, False)
    return base, model, x, cfg, record


def check_model(kind: str, folder: str, steps: int) -> None:
    base, model, x, cfg, record = _created(kind, folder)
    bad = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_cuda]
    assert not bad, f"{kind}: tensors left off the GPU: {bad[:4]}"
    plain = MODELS[kind][0]().cuda().train()
    for amp in (False, True):
        ours, ref = _median_ms(model, x, steps, amp), _median_ms(plain, x, steps, amp)
        print(f"{kind} {'bf16 autocast' if amp else 'fp32'}: step {ours:.2f} ms vs plain FP32 model "
              f"{ref:.2f} ms ({ours / ref:.2f}x)")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with HostReads() as reads:
        _step(model, x, opt, False)
        torch.cuda.synchronize()
    print(f"{kind}: host reads in a steady step: {reads.n} (the CPU suite's bound: <= 1)")

    model.eval()
    model(x)  # the first eval forward writes the record's scales
    pth = os.path.join(folder, f"{kind}.pth")
    torch.save({"state_dict": model.state_dict()}, pth)
    t = time.perf_counter()
    amct.save_compressed_retrain_model(model, record, os.path.join(folder, kind), x)
    assert all(p.is_cuda for p in model.parameters()), "save moved the model"
    print(f"{kind}: save from a CUDA model {time.perf_counter() - t:.1f} s")
    restored = amct.restore_compressed_retrain_model(MODELS[kind][0]().cuda(), x, cfg, record, pth, "state_dict")
    restored.eval()
    with torch.no_grad():
        assert torch.equal(model(x), restored(x)), f"{kind}: restored outputs differ"
    a, b = model.state_dict(), restored.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{kind}: restored state differs"
    print(f"{kind}: restore onto a CUDA model: identical outputs and state dict")

    model.train()
    explained = torch._dynamo.explain(lambda inp: model(inp).square().mean())(x)
    print(f"{kind}: torch.compile forward: {explained.graph_count} graphs, {explained.graph_break_count} breaks")
    for reason in sorted({str(r.reason).splitlines()[0][:120] for r in explained.break_reasons}):
        print(f"    {reason}")
    torch._dynamo.reset()
    eager = _step(model, x, torch.optim.SGD(model.parameters(), lr=0.0), False)
    compiled = torch.compile(model)
    t = time.perf_counter()
    loss = _step(compiled, x, torch.optim.SGD(model.parameters(), lr=0.0), False)
    torch.cuda.synchronize()
    print(f"{kind}: compiled step (first, with compilation) {time.perf_counter() - t:.1f} s, loss "
          f"{float(loss.detach()):.6g} vs eager {float(eager.detach()):.6g}")


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
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
        for _ in range(5):
            _step(ddp, x, opt, False)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        assert all(torch.equal(everyone[0], f) for f in everyone), "DDP ranks' parameters differ"
        if rank == 0:
            print(f"DDP (nccl, world size {world}): 5 steps, parameters identical on every rank")
        del ddp, opt, model
    finally:
        dist.destroy_process_group()


def check_ddp(folder: str) -> None:
    if not dist.is_nccl_available():
        print("DDP: skipped (this torch has no NCCL)")
        return
    with open(os.path.join(folder, "ddp.cfg"), "w") as f:
        f.write(CFG)
    world = torch.cuda.device_count()
    torch.multiprocessing.spawn(_ddp_worker, args=(world, folder, 29571), nprocs=world, join=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="openamct-gpu-") as folder:
        for kind in MODELS:
            check_model(kind, folder, args.steps)
        check_ddp(folder)
    print("gpu_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
