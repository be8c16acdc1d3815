"""A small video-style 3D CNN (Conv3d + BatchNorm3d, a residual block, a Linear head) through the
graph flow's whole lifecycle (lifecycle.run: create, train, restore exact, save, ORT and
OpenVINO), INT8 and with a 2:4 / filter-prune config: Conv3d takes neither (upstream sparsifies
and prunes 2-D convs and Linear), so those configs quantize it and prune only the head."""

import pytest
import torch
from torch import nn

from tests.zoo.lifecycle import CONFIGS, run

pytestmark = pytest.mark.slow


class Video3D(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(3, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8), nn.ReLU())
        self.down = nn.Sequential(nn.Conv3d(8, 16, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), bias=False),
                                  nn.BatchNorm3d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv3d(16, 16, 3, padding=1, bias=False), nn.BatchNorm3d(16))
        self.relu = nn.ReLU()
        self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        y = self.down(self.stem(x))
        y = self.relu(self.block(y) + y)
        return self.head(y.mean((2, 3, 4)))


def build():
    torch.manual_seed(0)
    return Video3D(), {"x": torch.randn(2, 3, 4, 16, 16)}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_conv3d_lifecycle(tmp_path, config):
    r = run(build, CONFIGS[config], str(tmp_path))
    assert r["quantized"] == 5, r  # three Conv3d and two Linear
    assert r["sparse"] == (2 if config.startswith("2:4") else 0), r  # the Linear head only
    assert r["pruned"] == (2 if config.startswith("filter") else 0), r
    assert r["fake_vs_torch"] >= 0.999 and r["fake_vs_torch_min"] >= 0.99, r
    assert r["deploy_vs_fake"] >= 0.99, r
