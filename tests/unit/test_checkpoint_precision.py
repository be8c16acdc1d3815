"""A checkpoint cast down to float16 / bfloat16 has lost the trained model's low bits: restore
refuses it, naming the key and the dtypes, instead of loading a model that computes otherwise.
A float64 checkpoint holds every float32 value exactly and restores the same model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import openamct as amct

QUANT = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def _trained(tmp_path):
    (tmp_path / "q.cfg").write_text(QUANT)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    m = amct.create_compressed_retrain_model(Net(), x, str(tmp_path / "q.cfg"), str(tmp_path / "r.txt"))
    m.train()
    m(x)
    m.eval()
    return m, x


def _restore(tmp_path, x):
    return amct.restore_compressed_retrain_model(Net(), x, str(tmp_path / "q.cfg"), str(tmp_path / "r.txt"),
                                                 str(tmp_path / "ck.pth"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_checkpoint_cast_down_is_refused(tmp_path, dtype):
    m, x = _trained(tmp_path)
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in m.state_dict().items()}
    torch.save(sd, tmp_path / "ck.pth")
    with pytest.raises(ValueError, match=rf"'conv.weight' has dtype {dtype}, which cannot hold the model's "
                                         r"torch.float32 values exactly"):
        _restore(tmp_path, x)


def test_a_float64_checkpoint_restores_the_same_model(tmp_path):
    m, x = _trained(tmp_path)
    sd = {k: v.double() if v.is_floating_point() else v for k, v in m.state_dict().items()}
    torch.save(sd, tmp_path / "ck.pth")
    r = _restore(tmp_path, x)
    r.eval()
    with torch.no_grad():
        assert torch.equal(r(x), m(x))
