"""Crash-safe resume: a real training process is SIGKILLed at random points while
openamct rewrites the record (2:4 masks with update_freq > 0, quant scales at each eval) and the
script writes checkpoints; after every kill:

- the record file is exactly one complete version openamct wrote (its sha256 is in the
  worker's journal), never a partial one, and parses;
- the checkpoint is complete and at least as new as the last one the worker announced;
- ``restore_compressed_retrain_model`` from it succeeds, and the restored model's eval outputs
  equal the outputs saved with that checkpoint (bit for bit);
- temporary files a kill leaves behind break nothing: the next run resumes with them present.

Then the worker is restarted in the same folder (it resumes from the checkpoint) and killed
again. A final restart runs to completion.
"""

from __future__ import annotations

import hashlib
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import openamct as amct
from openamct.record.file_io import read_record
from openamct.techniques.sparsity24 import masks_in_record
from tests.e2e._kill_worker import CFG, CKPT, JOURNAL, RECORD, KillNet, data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS, KILLS_PER_RUN = 3, 7
IN_WRITE = 5  # the kill of each run that lands inside a record write, by construction
NM_LAYERS = {"conv1.0", "conv2.0", "fc1", "fc2"}
QUANT_LAYERS = NM_LAYERS


def start(workdir: str, steps: int | None = None, pause_in_write: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.e2e._kill_worker", workdir]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if pause_in_write:
        cmd.append("--pause-in-record-write")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("ready"):
                return int(line.split()[1])
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise AssertionError(f"worker did not start: rc={proc.wait()} stderr={proc.stderr.read()[-3000:]}")


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 60.0) -> str:
    """Read stdout up to and including the first line starting with ``prefix``; returns it all."""
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            seen += line
            if line.startswith(prefix):
                return seen
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise AssertionError(f"worker never printed {prefix!r}: rc={proc.wait()} stderr={proc.stderr.read()[-3000:]}")


def announced_steps(stdout: str) -> list[int]:
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("ckpt ")]


def journal(workdir: str) -> set[str]:
    with open(os.path.join(workdir, JOURNAL)) as f:
        return {line.strip() for line in f if len(line.strip()) == 64}  # a kill may cut the last line


def check_state(workdir: str, last_announced: int) -> dict:
    """Everything a restarted job relies on; returns what was found."""
    found = {"temps": sorted(f for f in os.listdir(workdir) if ".tmp" in f)}
    rec = os.path.join(workdir, RECORD)
    if os.path.exists(rec):
        with open(rec, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        assert digest in journal(workdir), "the record on disk is not a version openamct wrote (partial?)"
        record = read_record(rec)
        masks = masks_in_record(record)
        assert set(masks) in (set(), NM_LAYERS)
        assert {e.key for e in record.record} in (set(), QUANT_LAYERS)
    ckpt = os.path.join(workdir, CKPT)
    if not os.path.exists(ckpt):
        assert last_announced < 0, "an announced checkpoint is gone"
        return found
    saved = torch.load(ckpt, weights_only=True)  # complete: a torn zip would not load
    assert saved["step"] >= last_announced, "the checkpoint is older than the last one announced"
    # Restore from a copy: a restored model rewrites its record at its first forward (the masks
    # it loaded from the checkpoint), and the worker's own record must stay what the kill left.
    scratch = os.path.join(workdir, "..", "scratch_record.txt")
    shutil.copyfile(rec, scratch)
    x = data()[0]
    model = amct.restore_compressed_retrain_model(KillNet(), x[:2], os.path.join(workdir, CFG), scratch, ckpt,
                                                  "state_dict")
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(saved["x"]), saved["y"]), f"restored outputs differ at step {saved['step']}"
    found["step"] = saved["step"]
    return found


@pytest.mark.slow
def test_sigkill_at_random_points_never_loses_data(tmp_path):
    torch.set_num_threads(1)  # as the worker: bit-equal outputs need the same kernels
    rng = random.Random(20240607)
    kills, restored, with_temp, steps_seen = 0, 0, 0, []
    t0 = time.monotonic()
    for run in range(RUNS):
        workdir = str(tmp_path / f"run{run}")
        os.makedirs(workdir)
        last = -1
        temps_before: set[str] = set()
        for k in range(KILLS_PER_RUN):
            proc = start(workdir, pause_in_write=k == IN_WRITE)
            consumed = ""
            if k in (0, 3):  # early: during start-up, create/restore or the first record writes
                time.sleep(rng.uniform(1.0, 3.5))
            elif k == IN_WRITE:  # exactly inside a record write: temp file complete, not renamed yet
                consumed = wait_for_line(proc, "writing ")
            else:
                resumed_at = wait_ready(proc)
                assert resumed_at >= max(last, 0)  # resumed from the newest checkpoint, nothing lost
                time.sleep(rng.uniform(0.0, 1.2))
            proc.send_signal(signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
            assert proc.returncode == -signal.SIGKILL, err[-3000:]
            kills += 1
            last = max([last, *announced_steps(consumed + out)])
            found = check_state(workdir, last)
            restored += "step" in found
            with_temp += bool(set(found["temps"]) - temps_before)  # this kill hit a write
            temps_before = set(found["temps"])
            steps_seen.append(found.get("step", 0))
        # A last restart runs to completion with the kills' leftovers still in the folder.
        proc = start(workdir, steps=max(last, 0) + 6)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        final = check_state(workdir, max(announced_steps(out)))
        assert final["step"] >= max(last, 0) + 3
    elapsed = time.monotonic() - t0
    print(f"\nkill-and-resume: {kills} SIGKILLs over {RUNS} runs, {restored} restores from a checkpoint "
          f"matched bit for bit, {with_temp} kills landed inside a file write, "
          f"checkpoint steps {steps_seen}, {elapsed:.0f} s")
    assert kills == RUNS * KILLS_PER_RUN
    assert with_temp >= RUNS  # at least the kills placed inside a write left a temporary file behind
    assert restored >= kills // 2  # most kills came after a checkpoint, so restore was exercised
