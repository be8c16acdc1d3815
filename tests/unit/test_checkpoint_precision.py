"""A checkpoint cast down to float16 / bfloat16 has lost the trained model's low bits: restore
refuses it, naming the key and the dtypes, instead of loading a model that computes otherwise.
A float64 checkpoint holds every float32 value exactly and restores the same model."""

from __future__ import annotations

import pytest
import torch

import openamct as amct
from tests.small import ConvFc, one_step


def _trained(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    return one_step(tmp_path, ConvFc(), x), x


def _restore(tmp_path, x):
    return amct.restore_compressed_retrain_model(ConvFc(), x, str(tmp_path / "q.cfg"), str(tmp_path / "r.txt"),
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
