"""A restore keeps the state dict's ``_metadata`` (each module's version) on every part it
loads: a module whose ``_load_from_state_dict`` reads ``local_metadata["version"]`` (torchvision's
MNASNet, BatchNorm's num_batches_tracked) must see the version the checkpoint was saved with."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import openamct as amct
from openamct.large import chunked_load

CFG = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"


class Versioned(nn.Module):
    """A scale whose checkpoint layout changed in version 2; a load without a version is refused
    (as MNASNet's ``ValueError: version should be set to 1 or 2 instead of None``)."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.seen: list = []

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        version = local_metadata.get("version")
        self.seen.append(version)
        if version not in (1, 2):
            raise ValueError(f"version should be set to 1 or 2 instead of {version}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def forward(self, x):
        return x * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 8)
        self.norm = Versioned()
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


@pytest.mark.parametrize("parts,zipped", [(1, True), (16, True), (1, False)])
def test_restore_passes_each_modules_version_to_its_load(tmp_path, parts, zipped, monkeypatch):
    """Mapped (zip) checkpoints load in parts (large/chunked_load.py); a legacy file, which
    cannot be mapped, in one ``load_state_dict``: both with the versions."""
    monkeypatch.setattr(chunked_load, "LOAD_PARTS", parts)
    cfg, rec, pth = (str(tmp_path / n) for n in ("q.cfg", "r.txt", "ckpt.pth"))
    with open(cfg, "w") as f:
        f.write(CFG)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    work = amct.create_quant_retrain_model(cfg, Net(), rec, x)
    with torch.no_grad():
        work(x)
        work.norm.scale.mul_(3)
    sd = work.state_dict()
    assert sd._metadata["norm"]["version"] == 2
    torch.save({"state_dict": sd}, pth, _use_new_zipfile_serialization=zipped)

    again = amct.restore_quant_retrain_model(cfg, Net(), rec, x, pth, "state_dict")
    assert again.norm.seen and set(again.norm.seen) == {2}
    assert torch.equal(again.norm.scale, work.norm.scale)
