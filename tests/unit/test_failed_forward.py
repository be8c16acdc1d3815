"""Issue 16, point 10: a forward that raises leaves no trace: the quantizers are not initialised
from that batch and the 2:4 step counters do not advance."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import openamct as amct

CFG = ("retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
       "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 1 } } }\n")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))  # needs a 1x1 spatial input


def test_a_failed_forward_initialises_nothing_and_counts_no_step(tmp_path):
    (tmp_path / "c.cfg").write_text(CFG)
    x = torch.randn(2, 8, 1, 1)
    m = amct.create_compressed_retrain_model(Net(), x, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"))
    m.train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    huge = torch.randn(2, 8, 4, 4) * 1000  # conv runs, fc fails on the shape
    with pytest.raises(RuntimeError):
        m(huge)
    after = m.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == [], changed
    assert not bool(m.conv.act_quant.initialized) and int(m.conv.sparsity.step) == 0
    m(x)  # the next good batch initialises from itself
    assert bool(m.conv.act_quant.initialized) and int(m.conv.sparsity.step) == 1
    assert m.conv.act_quant.clip_max.item() < 50


def test_a_failed_forward_is_also_undone_by_the_next_forward(tmp_path):
    (tmp_path / "c.cfg").write_text(CFG)
    x = torch.randn(2, 8, 1, 1)
    m = amct.create_compressed_retrain_model(Net(), x, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"))
    m.train()
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 8, 4, 4) * 1000)
    m(x)
    assert int(m.conv.sparsity.step) == 1 and m.conv.act_quant.clip_max.item() < 50
