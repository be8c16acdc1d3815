"""Training worker that ``test_kill_resume`` SIGKILLs at random points.

Run as ``python -m tests.e2e._kill_worker WORKDIR --steps N``. It trains a combined 2:4 + INT8
model (update_freq > 0, so openamct rewrites the record during training) and every few steps
writes a checkpoint holding the state dict, the step and the model's eval outputs on a fixed
batch. If WORKDIR already holds a checkpoint it resumes from it with
``restore_compressed_retrain_model``, as a user's job would after a crash.

The checkpoint is written the way a user should write one: ``torch.save`` to a temporary file
in the same folder, fsync, ``os.replace`` over the old one. The outputs live in the same file
as the weights, so they can never belong to another step.

``journal.txt`` lists the sha256 of every record version openamct writes, appended (and
fsynced) just before the write starts: the test checks that the record file on disk is always
exactly one of them. This only observes the writes; they are openamct's own.

stdout: ``ready <step>`` once training starts, ``ckpt <step>`` after each checkpoint is in place.

``--pause-in-record-write``: the worker's ``os.replace`` (a test-side wrapper, nothing in
openamct changes) announces ``writing <tmp>`` and sleeps before renaming a finished temporary
record over the real one, so the test can kill the process exactly inside a record write.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = """retrain_data_quant_config { ulq_quantize { } }
retrain_weight_quant_config { arq_retrain { } }
prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 2 } } }
"""
CKPT, RECORD, CFG, JOURNAL = "ckpt.pth", "record.txt", "retrain.cfg", "journal.txt"


class KillNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(4, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = self.pool(self.conv2(self.conv1(x))).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed training batch, labels and the reference eval batch."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 4, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g), \
        torch.randn(16, 4, 8, 8, generator=g)


def save_atomically(obj: dict, path: str) -> None:
    """The pattern a training script should use for checkpoints: a reader (or a restarted job)
    sees the old complete file or the new one, never half of one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def journal_record_writes(workdir: str) -> None:
    from openamct.record.file_io import record_to_text
    from openamct.training import keeper as session

    journal = open(os.path.join(workdir, JOURNAL), "a")
    journal.write("\n")  # ends a line a kill may have cut short
    write = session.write_record

    def journaled(path, record, header="", fast=None):
        digest = hashlib.sha256((header + record_to_text(record, fast)).encode("utf-8")).hexdigest()
        journal.write(digest + "\n")
        journal.flush()
        os.fsync(journal.fileno())
        write(path, record, header, fast)

    session.write_record = journaled


def pause_in_record_writes() -> None:
    import time

    replace = os.replace

    def slow_replace(src, dst, *args, **kwargs):
        if os.path.basename(dst) == RECORD:
            print(f"writing {os.path.basename(src)}", flush=True)
            time.sleep(60)
        return replace(src, dst, *args, **kwargs)

    os.replace = slow_replace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--steps", type=int, default=10**9, help="stop after this many steps in all")
    ap.add_argument("--ckpt-every", type=int, default=3)
    ap.add_argument("--pause-in-record-write", action="store_true")
    args = ap.parse_args()
    if args.pause_in_record_write:
        pause_in_record_writes()
    torch.set_num_threads(1)

    import openamct as amct

    journal_record_writes(args.workdir)
    cfg, rec, ckpt = (os.path.join(args.workdir, f) for f in (CFG, RECORD, CKPT))
    if not os.path.exists(cfg):
        with open(cfg, "w") as f:
            f.write(CONFIG)
    x, y, x_ref = data()
    if os.path.exists(ckpt):
        model = amct.restore_compressed_retrain_model(KillNet(), x[:2], cfg, rec, ckpt, "state_dict")
        step = int(torch.load(ckpt, weights_only=True)["step"])
    else:
        torch.manual_seed(0)
        model = amct.create_compressed_retrain_model(KillNet(), x[:2], cfg, rec)
        step = 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    print(f"ready {step}", flush=True)
    model.train()
    while step < args.steps:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % args.ckpt_every == 0:
            model.eval()
            with torch.no_grad():
                out = model(x_ref)  # the first eval forward also rewrites the record (scales)
            save_atomically({"state_dict": model.state_dict(), "step": step, "x": x_ref, "y": out}, ckpt)
            print(f"ckpt {step}", flush=True)
            model.train()


if __name__ == "__main__":
    main()
