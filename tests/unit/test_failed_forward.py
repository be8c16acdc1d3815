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


def test_a_mask_not_computed_yet_is_put_back_without_a_copy(tmp_path):
    """The first forward's snapshot keeps no copy of the all-kept masks it is due to compute
    (at 1.1B parameters 130 MB of new pages in the first step), and still puts them back."""
    from openamct.compressed import rollback

    (tmp_path / "c.cfg").write_text(CFG)
    x = torch.randn(2, 8, 1, 1)
    m = amct.create_compressed_retrain_model(Net(), x, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"))
    m.train()
    kept = m.conv.sparsity.mask_bits.clone()
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 8, 4, 4) * 1000)  # the conv computes its mask, then fc fails
    masks = [state[5] for sp, state in m._openamct._snapshot.items if sp is m.conv.sparsity]
    assert masks == [rollback._ALL_KEPT]
    m._openamct.undo_failed_forward()
    assert torch.equal(m.conv.sparsity.mask_bits, kept) and not m.conv.sparsity._ready


def test_a_mask_not_computed_but_not_all_kept_is_copied_and_put_back(tmp_path):
    (tmp_path / "c.cfg").write_text(CFG)
    x = torch.randn(2, 8, 1, 1)
    m = amct.create_compressed_retrain_model(Net(), x, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"))
    m.train()
    sp = m.conv.sparsity
    sp.mask_bits[3] = 0x5A  # as a checkpoint saved with mask_ready False could hold
    odd = sp.mask_bits.clone()
    assert not sp.holds_all_kept()
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 8, 4, 4) * 1000)
    assert not torch.equal(sp.mask_bits, odd)  # the failed forward computed a mask
    m._openamct.undo_failed_forward()
    assert torch.equal(sp.mask_bits, odd)


@pytest.mark.parametrize("shape", [(3, 4), (4, 8), (1, 4)])
def test_all_kept_is_recognised_and_rewritten_with_a_partial_last_byte(shape):
    from openamct.prune.nm import NMSparsifier

    sp = NMSparsifier(shape, 1, 0)
    start = sp.mask_bits.clone()
    assert sp.holds_all_kept()
    sp.mask_bits[-1] = 0xFF if start[-1] != 0xFF else 0x7F  # a different last byte
    assert not sp.holds_all_kept()
    sp.mask_bits.zero_()
    sp.reset_all_kept()
    assert torch.equal(sp.mask_bits, start) and sp.holds_all_kept()
