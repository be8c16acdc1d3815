"""Two models of one architecture sharing one record path: their filter pruning removed other
channels of the same counts, so keys and shapes agree. The model (and so its checkpoint)
carries a digest of those decisions: restore refuses the other model's record, and save refuses
to overwrite it, each naming the first layer that differs."""

from __future__ import annotations

import pytest
import torch

import openamct as amct
from tests.small import HALF_FILTERS, INT8, TwoConvFc, write_cfg

CFG = INT8 + HALF_FILTERS
X = torch.randn(2, 3, 8, 8)


def _net(seed: int) -> TwoConvFc:
    torch.manual_seed(seed)
    return TwoConvFc()


def _stepped(tmp_path, seed: int):
    """The model of ``seed`` created under CFG with record ``r.txt`` (the same path for every
    seed), after one training forward."""
    m = amct.create_compressed_retrain_model(_net(seed), X, write_cfg(tmp_path, CFG, "c.cfg"), str(tmp_path / "r.txt"))
    m.train()
    m(X)
    return m


def _pair(tmp_path):
    rec = str(tmp_path / "r.txt")
    a = _stepped(tmp_path, 0)
    torch.save(a.state_dict(), tmp_path / "a.pth")
    a_record = (tmp_path / "r.txt").read_text()
    b = _stepped(tmp_path, 1)  # same record path
    b._openamct.flush()
    assert (tmp_path / "r.txt").read_text() != a_record  # b's choices: the case this test is about
    assert a.conv1.weight.shape == b.conv1.weight.shape
    return a, b, rec


def test_restore_refuses_a_record_another_model_wrote_since(tmp_path):
    a, _, rec = _pair(tmp_path)
    with pytest.raises(ValueError, match=r"was trained with other decisions than record_file holds \(first at "
                                         r"layer 'conv1'\)"):
        amct.restore_compressed_retrain_model(_net(0), X, str(tmp_path / "c.cfg"), rec, str(tmp_path / "a.pth"))


def test_save_refuses_to_overwrite_another_models_record(tmp_path):
    a, b, rec = _pair(tmp_path)
    b_record = (tmp_path / "r.txt").read_text()
    a.eval()
    with pytest.raises(ValueError, match=r"record_file .* holds another model's decisions \(first at layer 'conv1'\)"):
        amct.save_compressed_retrain_model(a, rec, str(tmp_path / "a"), X)
    assert (tmp_path / "r.txt").read_text() == b_record
    assert not (tmp_path / "a_deploy_model.onnx").exists()
    amct.save_compressed_retrain_model(a, str(tmp_path / "a_own.txt"), str(tmp_path / "a"), X)  # its own path works
    r = amct.restore_compressed_retrain_model(_net(0), X, str(tmp_path / "c.cfg"), str(tmp_path / "a_own.txt"),
                                              str(tmp_path / "a.pth"))
    r.eval()
    with torch.no_grad():
        assert torch.equal(r(X), a(X))


def test_a_checkpoint_without_the_digest_still_restores(tmp_path):
    rec = str(tmp_path / "r.txt")
    a = _stepped(tmp_path, 0)
    sd = {k: v for k, v in a.state_dict().items() if k != "openamct_decisions"}
    assert len(sd) == len(a.state_dict()) - 1
    torch.save(sd, tmp_path / "old.pth")
    r = amct.restore_compressed_retrain_model(_net(0), X, str(tmp_path / "c.cfg"), rec, str(tmp_path / "old.pth"))
    a.eval()
    r.eval()
    with torch.no_grad():
        assert torch.equal(r(X), a(X))
