"""Graph capture runs the model once in eval mode; a module that caches a derived tensor there
(Hugging Face's LeViT keeps its attention biases in a dict filled on the first eval forward)
must not keep values computed from the weights before the checkpoint was loaded."""

from __future__ import annotations

import torch
from torch import nn

import openamct as amct
from tests.small import restores_the_same, write_cfg
from tests.training import sgd_steps


class CachedBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.table = nn.Parameter(torch.randn(4))
        self.idx = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0])
        self.cache: dict = {}  # filled in eval mode only, cleared by train()

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.cache:
            self.cache = {}
        return self

    def bias(self):
        if self.training:
            return self.table[self.idx]
        key = str(self.table.device)
        if key not in self.cache:
            self.cache[key] = self.table[self.idx]
        return self.cache[key]

    def forward(self, x):
        return self.fc(x) + self.bias()


def test_capture_leaves_an_eval_cache_as_it_found_it(tmp_path):
    cfg, rec = write_cfg(tmp_path), str(tmp_path / "r.txt")
    x = torch.randn(4, 8)
    model = CachedBias()
    m = amct.create_compressed_retrain_model(model, x, cfg, rec)
    assert model.cache == {}  # the caller's model: never touched
    assert m.cache == {}  # the working copy: capture's eval forward left no cached value
    sgd_steps(m, x, steps=3, lr=0.5)
    with torch.no_grad():
        m.table.add_(1.0)  # the trained table differs from the original model's
    restores_the_same(m, lambda ck: amct.restore_compressed_retrain_model(CachedBias(), x, cfg, rec, ck),
                      x, tmp_path / "ck.pth")
