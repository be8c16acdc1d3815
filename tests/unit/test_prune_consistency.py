"""A group whose channel removal the forward cannot follow (a width the forward checks or
reshapes to as a Python constant, out of the graph analysis's sight) stays whole at create,
with a WARNING; the other groups are pruned and the model trains, restores and saves."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import openamct as amct
from tests.small import HALF_FILTERS, INT8, restores_the_same
from tests.training import sgd_steps

FILTER = INT8 + HALF_FILTERS


class FixedWidth(nn.Module):
    """``stem`` -> ``mix`` is an ordinary prunable pair; ``proj``'s width is checked against a
    Python constant (timm's ``_assert(C == self.dim)``), which no graph analysis can see."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.mix = nn.Conv2d(16, 16, 3, padding=1)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.width = 16

    def forward(self, x):
        h = self.mix(torch.relu(self.stem(x)))
        t = h.flatten(2).transpose(1, 2)  # [b, tokens, 16]
        t = torch.relu(self.proj(t))
        if t.shape[-1] != self.width:
            raise RuntimeError(f"expected width {self.width}, got {t.shape[-1]}")
        return self.head(t.mean(dim=1))


def test_a_group_the_forward_cannot_follow_stays_whole(tmp_path, caplog):
    cfg = tmp_path / "f.cfg"
    cfg.write_text(FILTER)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    with caplog.at_level(logging.WARNING, logger="openamct.sparsity.consistency"):
        m = amct.create_compressed_retrain_model(FixedWidth(), x, str(cfg), str(tmp_path / "r.txt"))
    assert "group(s) left whole, because the model's forward fails once their channels are removed" in caplog.text
    assert "proj" in caplog.text
    assert m.proj.weight.shape[0] == 16  # left whole
    assert m.stem.weight.shape[0] < 16  # the group the forward follows is pruned
    sgd_steps(m, x, steps=2, lr=0.01)
    rec = str(tmp_path / "r.txt")
    r = restores_the_same(m, lambda ck: amct.restore_compressed_retrain_model(FixedWidth(), x, str(cfg), rec, ck),
                          x, tmp_path / "ck.pth")
    amct.save_compressed_retrain_model(r, str(tmp_path / "r.txt"), str(tmp_path / "m"), x)
    assert (tmp_path / "m_deploy_model.onnx").is_file()


class Branchy(nn.Module):
    """``side`` runs only when ``use_side`` is set: create's input_data never takes it."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.main = nn.Conv2d(16, 8, 3, padding=1)
        self.side = nn.Conv2d(16, 8, 1)
        self.head = nn.Linear(8, 4)
        self.use_side = False

    def forward(self, x):
        h = torch.relu(self.stem(x))
        y = self.main(h) + (self.side(h) if self.use_side else 0)
        return self.head(y.mean(dim=(2, 3)))


def test_a_layer_create_never_saw_fails_clearly_once_its_input_was_narrowed(tmp_path):
    cfg = tmp_path / "f.cfg"
    cfg.write_text(FILTER)
    x = torch.randn(2, 3, 8, 8)
    m = amct.create_compressed_retrain_model(Branchy(), x, str(cfg), str(tmp_path / "r.txt"))
    assert m.stem.weight.shape[0] < 16
    m.train()
    m(x)  # the branch create saw still trains
    m.use_side = True
    with pytest.raises(ValueError, match=r"layer 'side' never ran when create ran the model on input_data .* "
                                         r"narrowed its input to \d+ channels \(it expects 16\)"):
        m(x)
