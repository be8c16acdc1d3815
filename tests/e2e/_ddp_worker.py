"""DistributedDataParallel worker for ``test_ddp`` (run with ``torchrun --nproc_per_node=2 -m
tests.e2e._ddp_worker OUTDIR SCENARIO``; gloo on CPU).

Scenarios ``qat``, ``nm`` and ``combined`` each: create the compressed model on every rank
*before* wrapping it, wrap it in DDP, train on rank-specific data (so an unsynchronised clip
initialisation would diverge), run the first eval forward through the DDP wrapper, then:

- write every rank's state dict (the test compares them) and what each rank's *local* clip
  initialisation of the first layer would have been (the test checks they differ, i.e. the
  synchronisation mattered);
- log every record write per rank (the test checks rank 1 never writes);
- rank 0 checkpoints atomically; every rank restores from it and compares outputs, then trains
  the restored model one more step under DDP (resume works);
- rank 0 exports with ``save_*`` given the DDP-wrapped model and checks ONNX Runtime's output of
  the fake-quant model against the model.

Scenario ``digits``: QAT on the real digits for a few epochs, global batch ``GLOBAL_BATCH``
split over the ranks; rank 0 writes the test accuracy. ``train_digits`` is also what the test
calls for the single-process baseline, so both runs share every line but the wrapping.

Every rank deletes its DDP models and collects garbage before ``destroy_process_group`` (a gloo
run aborts at exit otherwise, see docs/ddp.md) and exits 0.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.digits import DigitsConvMLP

QUANT = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 2 } } }\n"
CONFIGS = {"qat": QUANT, "nm": NM, "combined": QUANT + NM}
GLOBAL_BATCH, EPOCHS, LR = 64, 15, 0.05


def create(api: str, model: nn.Module, x: torch.Tensor, cfg: str, rec: str) -> nn.Module:
    import openamct as amct

    if api == "qat":
        return amct.create_quant_retrain_model(cfg, model, rec, x)
    if api == "nm":
        return amct.create_prune_retrain_model(model, x, cfg, rec)
    return amct.create_compressed_retrain_model(model, x, cfg, rec)


def restore(api: str, model: nn.Module, x: torch.Tensor, cfg: str, rec: str, pth: str) -> nn.Module:
    import openamct as amct

    if api == "qat":
        return amct.restore_quant_retrain_model(cfg, model, rec, x, pth, "state_dict")
    if api == "nm":
        return amct.restore_prune_retrain_model(model, x, rec, cfg, pth, "state_dict")
    return amct.restore_compressed_retrain_model(model, x, cfg, rec, pth, "state_dict")


def save(api: str, model: nn.Module, cfg: str, rec: str, prefix: str, x: torch.Tensor) -> None:
    import openamct as amct

    if api == "qat":
        amct.save_quant_retrain_model(cfg, model, rec, prefix, x)
    elif api == "nm":
        amct.save_prune_retrain_model(model, prefix, x)
    else:
        amct.save_compressed_retrain_model(model, rec, prefix, x)


def log_record_writes(rank: int) -> None:
    """Log each record write of this rank to ``writes_rank<r>.txt`` next to the record (this
    only observes openamct's writes)."""
    from openamct.training import keeper as session

    write = session.write_record

    def logged(target, record, header="", fast=None):
        with open(os.path.join(os.path.dirname(target), f"writes_rank{rank}.txt"), "a") as f:
            f.write(f"{target}\n")
        write(target, record, header, fast)

    session.write_record = logged


def save_atomically(obj: dict, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def scenario(api: str, outdir: str, rank: int, world: int) -> None:
    from openamct.quant.clip_init import init_clips

    d = os.path.join(outdir, api)
    if rank == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    cfg, rec, ckpt = (os.path.join(d, f) for f in ("retrain.cfg", "record.txt", "ckpt.pth"))
    if rank == 0:
        with open(cfg, "w") as f:
            f.write(CONFIGS[api])
    dist.barrier()

    torch.manual_seed(0)  # the same FP32 init on every rank
    g = torch.Generator().manual_seed(100 + rank)  # rank-specific data
    xs = [torch.randn(16, 1, 8, 8, generator=g) * (1 + rank) for _ in range(6)]
    ys = [torch.randint(0, 10, (16,), generator=g) for _ in range(6)]
    x_eval = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(7))

    model = create(api, DigitsConvMLP(), x_eval[:2], cfg, rec)  # create first, then wrap
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    ddp.train()
    for xb, yb in zip(xs, ys, strict=True):
        loss = F.cross_entropy(ddp(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    train_end = {k: v.clone() for k, v in model.state_dict().items()}
    ddp.eval()
    with torch.no_grad():
        out = ddp(x_eval)  # through the wrapper: DDP syncs the buffers from rank 0 first
    torch.save({"state_dict": model.state_dict(), "out": out, "train_end": train_end,
                "local_clip_init": torch.tensor(init_clips(xs[0], False)[0])},
               os.path.join(d, f"state_rank{rank}.pt"))
    dist.barrier()  # rank 0's record write (first eval forward) is done

    if rank == 0:
        save_atomically({"state_dict": model.state_dict()}, ckpt)
    dist.barrier()
    restored = restore(api, DigitsConvMLP(), x_eval[:2], cfg, rec, ckpt)
    restored.eval()
    with torch.no_grad():
        same = bool(torch.equal(restored(x_eval), out))
    ddp2 = DDP(restored)  # resume under DDP
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=LR)
    ddp2.train()
    F.cross_entropy(ddp2(xs[0]), ys[0]).backward()
    opt2.step()
    # That step may write the record (a 2:4 mask update) on the background thread; state_dict
    # joins it, so that save() below rewrites the record after it, not racing it (both models
    # keep the same record file: nm failed once in a loaded run with the resumed masks written last)
    restored.state_dict()
    result = {"restored_equal": same, "resumed_step": True}

    if rank == 0:
        import numpy as np
        import onnxruntime as ort

        prefix = os.path.join(d, "model")
        save(api, ddp, cfg, rec, prefix, x_eval[:1])  # the DDP-wrapped model
        sess = ort.InferenceSession(f"{prefix}_fake_quant_model.onnx", providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        onnx_out = np.concatenate([sess.run(None, {name: x_eval[i:i + 1].numpy()})[0] for i in range(8)])
        result["onnx_max_diff"] = float(np.abs(onnx_out - out.numpy()).max())
        result["onnx_out"] = onnx_out.tolist()  # float32 values: exact through JSON
    with open(os.path.join(d, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    del ddp, ddp2, opt, opt2, model, restored
    gc.collect()
    dist.barrier()


def train_digits(rank: int = 0, world: int = 1, wrap: bool = False, epochs: int = EPOCHS,
                 workdir: str = ".") -> float:
    """QAT on the digits from one FP32 init; each global batch of GLOBAL_BATCH is split over
    the ranks. Returns the test accuracy (on every rank)."""
    import openamct as amct
    from examples.digits import load_digits

    x_tr, y_tr, x_te, y_te = load_digits()
    cfg = os.path.join(workdir, "digits.cfg")
    if rank == 0:
        with open(cfg, "w") as f:
            f.write(QUANT)
    if wrap:
        dist.barrier()
    torch.manual_seed(0)
    model = amct.create_quant_retrain_model(cfg, DigitsConvMLP(), os.path.join(workdir, "digits_record.txt"), x_te[:2])
    net = DDP(model) if wrap else model
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    per_rank = GLOBAL_BATCH // world
    steps, total = 0, epochs * (len(x_tr) // GLOBAL_BATCH)
    for epoch in range(epochs):
        net.train()
        order = torch.randperm(len(x_tr), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(order) - GLOBAL_BATCH + 1, GLOBAL_BATCH):  # full batches only
            idx = order[start + rank * per_rank:start + (rank + 1) * per_rank]
            loss = F.cross_entropy(net(x_tr[idx]), y_tr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            # Cosine decay: both runs settle on a plateau instead of stopping mid-oscillation.
            for group in opt.param_groups:
                group["lr"] = LR * 0.5 * (1.0 + math.cos(math.pi * steps / total))
    net.eval()
    with torch.no_grad():
        acc = float((net(x_te).argmax(1) == y_te).float().mean())
    del net, opt, model
    gc.collect()
    return acc


def main() -> None:
    outdir, which = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    log_record_writes(rank)
    try:
        if which == "digits":
            acc = train_digits(rank, world, wrap=True, workdir=outdir)
            with open(os.path.join(outdir, f"digits_rank{rank}.json"), "w") as f:
                json.dump({"accuracy": acc}, f)
        else:
            for api in which.split(","):
                scenario(api, outdir, rank, world)
    finally:
        gc.collect()  # every DDP object is gone before the group is (clean exit with gloo)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
