"""A NaN or inf in a training forward after calibration (a bad batch, a diverged optimizer
step) stops that forward with one error naming the layer it reached and the step, and leaves
every parameter and buffer as it was before the forward: no clip, BatchNorm statistic or 2:4
mask takes the value."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import openamct as amct
from tests.small import INT8, changed_keys, snapshot, write_cfg
from tests.training import sgd_steps

NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 1 } } }\n"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.mid = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)  # not folded (no conv before it reads only it): plain statistics
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        h = self.norm(h + self.mid(h))
        return self.fc(h.mean(dim=(2, 3)))


def _trained(tmp_path, cfg: str):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    m = amct.create_compressed_retrain_model(Net(), x, write_cfg(tmp_path, cfg, "c.cfg"), str(tmp_path / "r.txt"))
    sgd_steps(m, x, steps=3, lr=0.01)
    return m, x


@pytest.mark.parametrize("cfg", [INT8, INT8 + NM])
def test_a_nan_batch_is_refused_naming_the_layer_and_the_model_is_unchanged(tmp_path, cfg):
    m, x = _trained(tmp_path, cfg)
    before = snapshot(m)
    bad = x.clone()
    bad[0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"training step 4: a NaN/inf value reached layer 'conv': its input holds "
                                         r"1 NaN/inf value\(s\); the batch itself holds 1"):
        m(bad)
    assert changed_keys(before, m) == []
    m(x).square().mean().backward()  # training goes on with good batches


def test_clips_a_diverged_step_left_not_finite_are_named(tmp_path):
    m, x = _trained(tmp_path, INT8)
    with torch.no_grad():
        m.mid.act_quant.clip_max.fill_(float("inf"))
        m.mid.act_quant.clip_min.fill_(float("-inf"))
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"reached layer 'mid': its activation clips \(act_quant.clip_max\) hold "
                                         r"NaN/inf after the last optimizer step"):
        m(x)
    assert changed_keys(before, m) == []


def test_eval_forwards_are_not_checked(tmp_path):
    m, x = _trained(tmp_path, INT8)
    m.eval()
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with torch.no_grad():
        assert torch.isnan(m(bad)).any()  # an eval forward changes nothing: it is the caller's to judge
