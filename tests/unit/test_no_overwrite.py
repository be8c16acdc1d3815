"""A call never overwrites one of its own inputs nor a file that is
not a previous output of the same kind, and bad output paths are refused before any work."""

from __future__ import annotations

import os

import pytest
import torch

import openamct as amct
from openamct.record.file_io import read_record
from tests.small import INT8, NM, ConvFc, write_cfg

X = torch.randn(2, 8, 6, 6)


class Counted(ConvFc):
    """ConvFc (8 -> 16 -> 4) that counts its forward calls."""

    def __init__(self):
        super().__init__(c_in=8, width=16, outputs=4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def _cfg(tmp_path, text=INT8 + NM, name="retrain.cfg"):
    return write_cfg(tmp_path, text, name)


def _trained(tmp_path):
    cfg, rec = _cfg(tmp_path), str(tmp_path / "rec.txt")
    m = amct.create_compressed_retrain_model(Counted(), X, cfg, rec)
    m.train()
    m(X)
    m.eval()
    m(X)
    pth = str(tmp_path / "ck.pth")
    torch.save({"sd": m.state_dict()}, pth)
    return m, cfg, rec, pth


def test_record_file_naming_the_config_is_refused_and_the_config_kept(tmp_path):
    cfg = _cfg(tmp_path)
    model = Counted()
    with pytest.raises(ValueError, match="record_file .* is the same file as config_defination"):
        amct.create_compressed_retrain_model(model, X, cfg, cfg)
    with pytest.raises(ValueError, match="record_file .* is the same file as config_file"):
        amct.create_quant_retrain_model(_cfg(tmp_path, INT8, "q.cfg"), model, str(tmp_path / "q.cfg"), X)
    assert open(cfg).read() == INT8 + NM
    assert model.calls == 0  # refused before any work


def test_record_file_naming_a_checkpoint_is_refused_at_create_and_restore(tmp_path):
    m, cfg, rec, pth = _trained(tmp_path)
    before = open(pth, "rb").read()
    with pytest.raises(ValueError, match=r"record_file .*ck.pth' exists and is not an openamct/AMCT record file"):
        amct.create_compressed_retrain_model(Counted(), X, cfg, pth)
    with pytest.raises(ValueError, match="record_file and pth_file are the same file"):
        amct.restore_compressed_retrain_model(Counted(), X, cfg, pth, pth, "sd")
    with pytest.raises(ValueError, match="config_defination and record_file are the same file"):
        amct.restore_compressed_retrain_model(Counted(), X, rec, rec, pth, "sd")
    assert open(pth, "rb").read() == before
    amct.restore_compressed_retrain_model(Counted(), X, cfg, rec, pth, "sd")  # still loads


def test_an_existing_record_is_overwritten_as_before(tmp_path):
    _, cfg, rec, _ = _trained(tmp_path)  # a previous record with trained clips and masks
    trained = read_record(rec)
    assert trained.record and trained.prune_record[0].selective_prune.attr
    fresh = str(tmp_path / "fresh.txt")
    amct.create_compressed_retrain_model(Counted(), X, cfg, fresh)
    amct.create_compressed_retrain_model(Counted(), X, cfg, rec)
    # the old record is replaced by what a create writes, nothing of the trained one is kept
    assert open(rec).read() == open(fresh).read()
    assert read_record(rec) != trained


def test_create_quant_retrain_config_never_replaces_a_retrain_cfg(tmp_path):
    cfg = _cfg(tmp_path, INT8)
    with pytest.raises(ValueError, match=r"config_file .*retrain.cfg' exists and is not a quant config JSON"):
        amct.create_quant_retrain_config(cfg, Counted(), X)
    with pytest.raises(ValueError, match="config_file .* is the same file as config_defination"):
        amct.create_quant_retrain_config(cfg, Counted(), X, cfg)
    assert open(cfg).read() == INT8
    js = str(tmp_path / "q.json")
    amct.create_quant_retrain_config(js, Counted(), X, cfg)
    amct.create_quant_retrain_config(js, Counted(), X, cfg)  # its own earlier output: overwritten


def test_save_never_overwrites_an_input_or_a_foreign_file(tmp_path):
    m, cfg, rec, pth = _trained(tmp_path)
    with pytest.raises(ValueError, match="save_path .* is the same file as record_file"):
        amct.save_compressed_retrain_model(m, str(tmp_path / "m_fake_quant_model.onnx"), str(tmp_path / "m"), X)
    (tmp_path / "m_deploy_model.onnx").write_text("my notes")
    with pytest.raises(ValueError, match="save_path .*m_deploy_model.onnx' exists and is not an ONNX model"):
        amct.save_compressed_retrain_model(m, rec, str(tmp_path / "m"), X)
    assert (tmp_path / "m_deploy_model.onnx").read_text() == "my notes"
    assert not (tmp_path / "m_fake_quant_model.onnx").exists()
    qcfg = _cfg(tmp_path, INT8, "q.cfg")
    with pytest.raises(ValueError, match="record_file .* is the same file as config_file"):
        amct.save_quant_retrain_model(qcfg, m, qcfg, str(tmp_path / "n"), X)


BAD_PATHS = [("", "is empty"), ("/", "is a directory"), ("DIR", "is a directory"),
             ("a\0b", "contains a NUL byte"), ("/proc/rec.txt", "is not writable"),
             ("FILE/rec.txt", "is a file, not a folder")]


@pytest.mark.parametrize("path,msg", BAD_PATHS)
def test_bad_record_paths_are_refused_before_any_work(tmp_path, path, msg):
    """(A missing folder is made, as upstream makes it: a path through a file cannot be.)"""
    (tmp_path / "f").write_text("not a folder")
    path = str(tmp_path) if path == "DIR" else str(tmp_path / "f" / "rec.txt") if path.startswith("FILE") else path
    model = Counted()
    with pytest.raises(ValueError, match=f"record_file.*{msg}"):
        amct.create_compressed_retrain_model(model, X, _cfg(tmp_path), path)
    with pytest.raises(ValueError, match=f"record_file.*{msg}"):
        amct.create_quant_retrain_model(_cfg(tmp_path, INT8), model, path, X)
    assert model.calls == 0


def test_read_only_save_folder_is_refused_before_export(tmp_path):
    m, *_ = _trained(tmp_path)
    with pytest.raises(ValueError, match="save_path .*folder '/proc' is not writable"):
        amct.save_compressed_retrain_model(m, str(tmp_path / "rec2.txt"), "/proc/model", X)
    assert not os.path.exists(tmp_path / "rec2.txt")


def test_a_large_record_is_recognised_by_its_start_and_a_large_other_file_refused(tmp_path):
    """Above 1 MB a record is judged by its first entry, not parsed whole (parsing a
    250M-parameter model's record twice made up a third of save)."""
    from openamct.output_paths import check_output

    rec, other = tmp_path / "big.txt", tmp_path / "notes.txt"
    entry = 'record {\n  key: "fc"\n  value {\n    scale_d: 0.5\n    offset_d: 0\n  }\n}\n'
    rec.write_text("# openamct-fingerprint: 0123456789abcdef (1 layers)\n" + entry * (1 + (2 << 20) // len(entry)))
    other.write_text("just some notes, not a record {\n" * 70000)
    assert rec.stat().st_size > 1 << 20 and other.stat().st_size > 1 << 20
    assert check_output("record_file", str(rec), "record") == str(rec)
    with pytest.raises(ValueError, match="exists and is not an openamct/AMCT record file"):
        check_output("record_file", str(other), "record")
