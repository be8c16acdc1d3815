"""Data-aware 2:4 masks (openamct's ``activation_aware_prune``): the |w| * ||x|| criterion,
better outputs than magnitude masks on inputs with uneven feature scales, record and restore."""

from __future__ import annotations

import torch
from torch import nn

import openamct as amct
from openamct.sparsity.nm import nm_keep_flags
from openamct.sparsity.nm_aware import DataAwareNMSparsifier


def _model_and_data():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8)).eval()
    scale = torch.logspace(-2, 1, 32)[torch.randperm(32)]  # input features of very different size

    def batch(n=16):
        return torch.randn(n, 32) * scale
    return m, batch


def _cfg(tmp_path, algo: str) -> str:
    p = tmp_path / f"{algo}.cfg"
    p.write_text(f"batch_num: 2\nprune_config {{ n_out_of_m_pruner {{ {algo} {{ n_out_of_m_type: M4N2 }} }} }}\n")
    return str(p)


def test_mask_is_the_wanda_criterion():
    w = torch.randn(6, 8)
    x = [torch.randn(5, 8) * torch.arange(1, 9), torch.randn(3, 8)]
    sp = DataAwareNMSparsifier((6, 8), axis=1, batch_num=2)
    for b in x:
        sp.observe(b)
    sp.observe(torch.randn(4, 8) * 100)  # past batch_num: not counted
    norms = torch.cat(x).double().square().sum(0).sqrt()
    want = nm_keep_flags((w.double() * norms).float(), 1, 2, 4, 1)
    sp.train()(w)
    assert torch.equal(sp.mask, want)
    assert not torch.equal(want, nm_keep_flags(w, 1, 2, 4, 1))  # not the magnitude mask here


def test_data_aware_masks_beat_magnitude_and_restore(tmp_path):
    m, batch = _model_and_data()
    x = batch(4)
    torch.manual_seed(2)
    calib = [batch() for _ in range(2)]
    held = batch(64)
    errs = {}
    for algo in ("l1_selective_prune", "activation_aware_prune"):
        rec = str(tmp_path / f"{algo}.record")
        s = amct.create_prune_retrain_model(m, x, _cfg(tmp_path, algo), rec)
        s.train()
        with torch.no_grad():
            for b in calib:
                s(b)
        s.eval()
        with torch.no_grad():
            errs[algo] = float((s(held) - m(held)).square().mean() / m(held).square().mean())
        pth = str(tmp_path / f"{algo}.pth")
        torch.save(s.state_dict(), pth)
        amct.save_prune_retrain_model(s, str(tmp_path / algo), x)  # flushes the record
        r = amct.restore_prune_retrain_model(m, x, rec, _cfg(tmp_path, algo), pth)
        assert torch.equal(r[0].sparsity.mask, s[0].sparsity.mask)
        with torch.no_grad():
            assert torch.equal(r.eval()(held), s(held))
    assert errs["activation_aware_prune"] < 0.7 * errs["l1_selective_prune"], errs
