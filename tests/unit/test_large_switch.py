"""The large-model switch: which path a model takes, that the large path computes what the
plain one does, and that ordinary models keep upstream's record format."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.pipeline import takes_large_path
from openamct.record.file_io import read_record
from tests.small import INT8, NM, write_cfg


class MLP(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(32, width), nn.Linear(width, width), nn.Linear(width, 4)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def test_import_openamct_loads_nothing_of_the_large_path():
    code = "import sys, openamct, openamct.cli; print(sorted(m for m in sys.modules if m.startswith('openamct.large')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_switch_picks_the_path_and_refuses_what_it_cannot_do(tmp_path):
    x = torch.randn(8, 32)
    cfg = write_cfg(tmp_path, INT8 + NM)
    small = amct.create_compressed_retrain_model(MLP(), x, cfg, str(tmp_path / "a.txt"))
    assert small._openamct.large_model is False and small.a.large is None
    forced = amct.create_compressed_retrain_model(MLP(), x, cfg, str(tmp_path / "b.txt"), large_model=True)
    assert forced._openamct.large_model is True and forced.a.large is not None
    assert forced.a.sparsity.apply_packed is not None and small.a.sparsity.apply_packed is None
    with pytest.raises(TypeError, match="large_model"):
        amct.create_compressed_retrain_model(MLP(), x, cfg, str(tmp_path / "c.txt"), large_model="yes")
    # (create refuses a meta model before this: the rule, on a model off the CPU)
    with pytest.raises(ValueError, match=r"large_model=True: .*CPU only.*meta"):
        takes_large_path(MLP().to("meta"), True)
    assert not takes_large_path(MLP().to("meta"), None) and not takes_large_path(MLP(), False)


def _train(model, x, y, steps=3):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.eval()


def test_the_large_path_trains_and_saves_what_the_plain_path_does(tmp_path):
    """Same model, same steps, each path: the same weights and outputs, and deploy files that
    ONNX Runtime runs to the same outputs (the large path saves a weight at a time)."""
    torch.manual_seed(0)
    base, x, y = MLP(), torch.randn(16, 32), torch.randn(16, 4)
    cfg = write_cfg(tmp_path, INT8 + NM)
    runs = {}
    for large in (False, True):
        rec = str(tmp_path / f"r{int(large)}.txt")
        m = _train(amct.create_compressed_retrain_model(copy.deepcopy(base), x, cfg, rec, large_model=large), x, y)
        with torch.no_grad():
            out = m(x)
        amct.save_compressed_retrain_model(m, rec, str(tmp_path / f"m{int(large)}"), x)
        s = ort.InferenceSession(str(tmp_path / f"m{int(large)}_deploy_model.onnx"), providers=["CPUExecutionProvider"])
        runs[large] = (m.state_dict(), out, s.run(None, {s.get_inputs()[0].name: x.numpy()})[0])
    (sd0, out0, ort0), (sd1, out1, ort1) = runs[False], runs[True]
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert torch.allclose(sd0[k].float(), sd1[k].float(), rtol=1e-5, atol=1e-6), k
    scale = float(out0.abs().max())
    assert torch.allclose(out0, out1, atol=1e-5 * scale)
    assert np.allclose(ort0, ort1, atol=1e-4 * scale)


def test_an_ordinary_record_keeps_its_masks_inline_whatever_their_size(tmp_path):
    """Upstream reads a record's masks only as ``selective_mask`` words: a model with more than
    4,194,304 masked weights keeps them there unless it takes the large path."""
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2048, 2100)

        def forward(self, x):
            return self.fc(x)

    x = torch.randn(2, 2048)
    cfg = write_cfg(tmp_path, NM)
    for large, rec in ((None, tmp_path / "plain.txt"), (True, tmp_path / "large.txt")):
        m = amct.create_prune_retrain_model(Wide(), x, cfg, str(rec), large_model=large)
        m.train()
        m(x)
        m._openamct.flush()
        names = {a.name for e in read_record(str(rec)).prune_record for a in e.selective_prune.attr}
        if large:
            assert "mask_file" in names and "selective_mask" not in names
        else:
            assert "selective_mask" in names and "mask_file" not in names
            assert not list(tmp_path.glob("plain.txt.masks-*"))
