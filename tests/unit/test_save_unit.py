"""The two files of one save are a pair (one save id in their ONNX
metadata_props), ``openamct verify`` refuses a pair from different saves, and the next save
removes the temporary files a killed save left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import onnx
import pytest
import torch

import openamct as amct
from openamct.export.verify import verify_pair
from openamct.export.writer import SAVE_ID_KEY
from tests.trained_record import CONV_FC_CFG as CFG  # noqa: E402
from tests.trained_record import CONV_FC_X as X  # noqa: E402
from tests.trained_record import ConvFcNet as Net  # noqa: E402


def _model(tmp_path, seed):
    torch.manual_seed(seed)
    cfg = tmp_path / "c.cfg"
    cfg.write_text(CFG)
    m = amct.create_compressed_retrain_model(Net(), X, str(cfg), str(tmp_path / f"rec{seed}.txt"))
    m.train()
    m(X)
    m.eval()
    m(X)
    return m


def _ids(prefix):
    out = []
    for kind in ("fake_quant", "deploy"):
        meta = {p.key: p.value for p in onnx.load(f"{prefix}_{kind}_model.onnx").metadata_props}
        out.append(meta.get(SAVE_ID_KEY))
    return out


def test_both_files_of_a_save_carry_one_id_and_a_mixed_pair_is_refused(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    amct.save_compressed_retrain_model(_model(tmp_path, 0), str(tmp_path / "rec0.txt"), a, X)
    amct.save_compressed_retrain_model(_model(tmp_path, 1), str(tmp_path / "rec1.txt"), b, X)
    ida, idb = _ids(a), _ids(b)
    assert ida[0] == ida[1] and idb[0] == idb[1] and ida[0] and ida[0] != idb[0]
    verify_pair(f"{a}_fake_quant_model.onnx", f"{a}_deploy_model.onnx", (2, 8, 6, 6), runs=1)
    # what a SIGKILL between the two renames leaves: the new fake-quant file, the old deploy file
    with pytest.raises(ValueError, match=r"_fake_quant_model.onnx' and .*b_deploy_model.onnx' are not from the "
                                         r"same save \(save id [0-9a-f]{32} vs [0-9a-f]{32}\)"):
        verify_pair(f"{a}_fake_quant_model.onnx", f"{b}_deploy_model.onnx", (2, 8, 6, 6), runs=1)


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    left = [f".openamct-export-{dead}-k2j3h4_1", f".m_fake_quant_model.onnx.{dead}-abcd1234.tmp",
            f".m_deploy_model.onnx.{dead}-x_y1z2w3.tmp", f".openamct-save-{dead}-aaaa1111"]
    os.mkdir(tmp_path / left[0])
    (tmp_path / left[0] / "model.onnx").write_bytes(b"half")
    for name in left[1:3]:
        (tmp_path / name).write_bytes(b"half a model")
    os.mkdir(tmp_path / left[3])
    live = f".m_deploy_model.onnx.{os.getpid()}-livelive.tmp"  # a save still running in this process
    (tmp_path / live).write_bytes(b"in progress")
    mine = tmp_path / "notes.tmp"
    mine.write_text("the user's")
    amct.save_compressed_retrain_model(_model(tmp_path, 0), str(tmp_path / "rec0.txt"), str(tmp_path / "m"), X)
    names = set(os.listdir(tmp_path))
    assert not names & set(left), names & set(left)
    assert live in names and "notes.tmp" in names
    assert not [n for n in names if n.startswith(".openamct-")]
    shutil.rmtree(tmp_path)
