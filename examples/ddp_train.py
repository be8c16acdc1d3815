"""2:4 sparsity + INT8 QAT under DistributedDataParallel, on the real 8x8 digits (CPU, gloo).

    torchrun --nproc_per_node=2 examples/ddp_train.py --out runs/ddp --epochs 10

Run it again with the same ``--out`` and a larger ``--epochs`` and it resumes from the last
checkpoint. See docs/ddp.md for the rules this script follows:

1. ``create_*`` / ``restore_*`` on the plain model on every rank, *then* wrap it in DDP;
2. every rank runs the first forward passes (they initialise the activation clips together);
3. openamct writes the record on rank 0 only; the script checkpoints on rank 0 only,
   atomically (temp file + ``os.replace``), and the other ranks wait at a barrier;
4. ``save_*`` on rank 0 accepts the DDP-wrapped model;
5. before ``destroy_process_group``: ``del`` every DDP model and optimizer and ``gc.collect()``,
   or a gloo job may abort at exit.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.* importable

import openamct as amct  # noqa: E402
from examples.digits import DigitsConvMLP, load_digits  # noqa: E402

CONFIG = """# INT8 activations (learned clips) and weights, 2:4 sparsity re-decided every 2 steps
retrain_data_quant_config { ulq_quantize { } }
retrain_weight_quant_config { arq_retrain { } }
prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 2 } } }
"""


def save_atomically(obj: dict, path: str) -> None:
    """A crash mid-save leaves the previous checkpoint intact."""
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/ddp", help="folder for config, record, checkpoint and ONNX files")
    ap.add_argument("--epochs", type=int, default=10, help="train until this many epochs in all")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch (split over the ranks)")
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()

    dist.init_process_group("gloo")  # "nccl" (and a device per rank) on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, rec, ckpt = (os.path.join(args.out, f) for f in ("retrain.cfg", "record.txt", "checkpoint.pth"))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if not os.path.exists(cfg):
            with open(cfg, "w") as f:
                f.write(CONFIG)
    dist.barrier()  # the folder and config exist before any rank reads them

    x_tr, y_tr, x_te, y_te = load_digits()
    torch.manual_seed(0)  # the same FP32 init on every rank (DDP would broadcast rank 0's anyway)
    if os.path.exists(ckpt):
        model = amct.restore_compressed_retrain_model(DigitsConvMLP(), x_te[:2], cfg, rec, ckpt, "state_dict")
        start = int(torch.load(ckpt, weights_only=True)["epoch"])
    else:
        model = amct.create_compressed_retrain_model(DigitsConvMLP(), x_te[:2], cfg, rec)
        start = 0
    ddp = DDP(model)  # wrap the model create_*/restore_* returned, never the other way round
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(TensorDataset(x_tr, y_tr), shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=args.batch_size // world, sampler=sampler,
                        drop_last=True)
    total = max(1, args.epochs * len(loader))

    acc = float("nan")
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for i, (xb, yb) in enumerate(loader):
            for group in opt.param_groups:  # cosine decay over the whole run
                group["lr"] = args.lr * 0.5 * (1.0 + math.cos(math.pi * (epoch * len(loader) + i) / total))
            loss = F.cross_entropy(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        # Evaluate on every rank, through the wrapper: DDP syncs BN statistics from rank 0
        # first, so a forward on rank 0 alone would block, waiting for the others.
        ddp.eval()
        with torch.no_grad():
            acc = float((ddp(x_te).argmax(1) == y_te).float().mean())
        if rank == 0:
            save_atomically({"state_dict": model.state_dict(), "epoch": epoch + 1}, ckpt)
            print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f}, test accuracy {acc:.4f}", flush=True)
        dist.barrier()  # nobody reads the checkpoint before it is complete

    if rank == 0:
        prefix = os.path.join(args.out, "digits")
        amct.save_compressed_retrain_model(ddp, rec, prefix, x_te[:1])  # unwraps the DDP model
        print(f"final test accuracy {acc:.4f}; wrote {prefix}_fake_quant_model.onnx and "
              f"{prefix}_deploy_model.onnx", flush=True)
    dist.barrier()

    del ddp, opt, model  # no DDP object may outlive the process group ...
    gc.collect()
    dist.destroy_process_group()  # ... or gloo aborts at exit ("terminate called ...")


if __name__ == "__main__":
    main()
