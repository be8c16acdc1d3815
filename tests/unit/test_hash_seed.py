"""Nothing openamct writes may depend on Python's hash seed: str hashing is salted per process
(PYTHONHASHSEED), so iterating a set of layer names gives another order in every run, and a
record or ONNX file built in that order differs between runs, ranks and machines.

Two processes with PYTHONHASHSEED=1 and =2 run the same create -> train -> save -> restore ->
save (tests/unit/_hash_seed_worker.py, one torch thread each, so their float arithmetic is the
same) and must write the same bytes. About 7 s: both run at once.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "unit", "_hash_seed_worker.py")
SEEDS = ("1", "2")
CREATED = ["record.txt", "m_fake_quant_model.onnx", "m_deploy_model.onnx"]
RESTORED = ["restored_record.txt", "r_fake_quant_model.onnx", "r_deploy_model.onnx"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    started = {}
    for seed in SEEDS:
        out = tmp_path_factory.mktemp(f"hashseed{seed}")
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"}
        started[seed] = (out, subprocess.Popen([sys.executable, WORKER, str(out)], cwd=ROOT, env=env,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for seed, (_, proc) in started.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"PYTHONHASHSEED={seed}: {err[-3000:]}"
    return {seed: out for seed, (out, _) in started.items()}


def test_create_and_save_write_the_same_bytes_under_any_hash_seed(runs):
    a, b = (runs[s] for s in SEEDS)
    for name in CREATED:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    text = (a / "record.txt").read_text()
    # conv outputs with an output quantizer (the residual Add's, the pool's, and the one read by
    # the next block's expand conv and its residual Add) and one residual block output hooked
    act = text.count('s: "activation_quant"')
    assert text.count("selective_prune") - act == 5 and act == 4  # 2:4 masks; activation_quant
    assert text.count('s: "residual"') == 1
    assert "prune_record" in text and "scale_d" in text  # all four techniques


def test_restored_model_exports_what_the_trained_model_exported(runs):
    # restore replays the record and loads the checkpoint: the same arithmetic, exactly
    for out in runs.values():
        for created, restored in zip(CREATED[1:], RESTORED[1:], strict=True):
            assert (out / created).read_bytes() == (out / restored).read_bytes(), restored


# Found by this test: restore used to list the 2:4 layers in set (hash) order; the technique
# now reads them in plan order (openamct/techniques/sparsity24.py, from_record).
def test_restore_rewrites_the_record_it_read_under_any_hash_seed(runs):
    for seed, out in runs.items():
        assert (out / "restored_record.txt").read_text() == (out / "record.txt").read_text(), seed
