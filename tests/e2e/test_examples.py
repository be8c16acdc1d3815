"""Every AMCT-style script in examples/ runs as a user would run it (small epochs) and leaves
working ONNX files behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import onnx
import pytest

from examples.digits import load_digits
from openamct.demo import bench
from openamct.record.file_io import read_record
from tests.conftest import checkout_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = ["prune_retrain.py", "compressed_retrain.py", "quant_retrain.py"]


def run_script(name: str, out: str) -> str:
    # One torch thread: on a shared 2-core machine two spinning threads per process are slow.
    env = checkout_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), "--epochs", "2", "--out", out],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def deploy_accuracy(path: str) -> float:
    """The scripts' own measurement (bench.session: 2 ORT threads, batches of 250), so the same
    file gives the same logits bit for bit: ORT's default thread count is the machine's core
    count, and another split of the work may round the float parts differently."""
    data = load_digits()
    return bench.onnx_accuracy(bench.session(path), data.x_test, data.y_test)


def int8_initializers(path: str) -> int:
    return sum(t.data_type == onnx.TensorProto.INT8 for t in onnx.load(path).graph.initializer)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_script_runs_and_its_onnx_files_work(tmp_path, script):
    out = str(tmp_path / "run")
    stdout = run_script(script, out)
    printed = {k: float(v) for k, v in re.findall(r"(FP32 accuracy|deploy ONNX accuracy|deploy ONNX) ([0-9.]+)", stdout)}
    deploy_key = "deploy ONNX accuracy" if script == "prune_retrain.py" else "deploy ONNX"
    # 2 epochs: FP32 97.6-97.8 %, deploy 98.0-99.1 % measured over 4 inits, far above the bound.
    assert printed["FP32 accuracy"] > 0.85, stdout
    deploy = os.path.join(out, "digits_deploy_model.onnx")
    fake = os.path.join(out, "digits_fake_quant_model.onnx")
    # What the script printed is what the file on disk does (same measurement: up to the print's
    # 4 decimals).
    acc = deploy_accuracy(deploy)
    assert acc == pytest.approx(printed[deploy_key], abs=5e-5)
    assert acc > 0.85
    record = read_record(os.path.join(out, "record.txt"))
    if script == "prune_retrain.py":
        assert open(fake, "rb").read() == open(deploy, "rb").read()  # prune-only: the same float model
        assert int8_initializers(deploy) == 0
        assert any(pr.HasField("selective_prune") for pr in record.prune_record)
        assert any(not pr.HasField("selective_prune") for pr in record.prune_record)
    else:
        assert int8_initializers(deploy) >= 3
        assert len(record.record) >= 3  # INT8 scales of every quantized layer
    if script == "quant_retrain.py":
        assert os.path.isfile(os.path.join(out, "quant_config.json"))
        assert "head.2" not in {e.key for e in record.record}  # the .cfg kept the classifier float
    if script == "compressed_retrain.py":
        assert len(record.prune_record) >= 2  # a filter group and 2:4 masks
