"""A record write that a training forward triggers runs on a background thread (a large
model's record write would otherwise stall that step)."""

import logging
import shutil
import threading

import torch

import openamct as amct
from openamct.training import keeper as keeper_mod
from tests.models import MODELS

CFG = "prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 0 } } }\n"


def create(tmp_path, folder):
    cfg = tmp_path / "c.cfg"
    cfg.write_text(CFG)
    x = torch.randn(2, 3, 32, 32)
    return amct.create_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], str(cfg), str(folder / "r.txt")), x


def test_the_first_steps_record_is_written_off_the_training_thread_and_state_dict_waits(tmp_path, monkeypatch):
    writers = []
    real = keeper_mod.write_record

    def spy(path, record, header="", fast=None):
        writers.append(threading.current_thread().name)
        real(path, record, header, fast)

    monkeypatch.setattr(keeper_mod, "write_record", spy)
    model, x = create(tmp_path, tmp_path)
    assert writers == ["MainThread"]  # create writes at once
    assert "selective_prune" not in (tmp_path / "r.txt").read_text()
    model.train()
    model(x).square().mean().backward()
    model.state_dict()  # a checkpoint is taken: the record it goes with is on disk first
    assert writers == ["MainThread", "openamct-record"]
    assert model._openamct._writer is None
    assert "selective_prune" in (tmp_path / "r.txt").read_text()


def test_a_failed_background_write_is_logged_once_and_retried(tmp_path, caplog):
    folder = tmp_path / "gone"
    folder.mkdir()
    model, x = create(tmp_path, folder)
    shutil.rmtree(folder)
    model.train()
    with caplog.at_level(logging.ERROR, logger="openamct.training.keeper"):
        model(x)  # masks computed: the write fails on its thread
        model._openamct._writer.join()
        model(x)  # the failure is learnt at the next forward: logged, and the write tried again
        model._openamct.wait()  # fails again: not logged twice
        model(x)
        model._openamct.wait()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "cannot be written" in errors[0].getMessage()
    folder.mkdir()
    model(x)
    model._openamct.wait()
    assert "selective_prune" in (folder / "r.txt").read_text()


def test_an_unchanged_record_is_not_rewritten_and_a_changed_one_is(tmp_path):
    """save after the eval forward that wrote the scales finds nothing new; after more training
    it writes again. Either way the record holds what the ONNX files were made from."""
    cfg = tmp_path / "q.cfg"
    cfg.write_text("retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
                   + CFG)
    x = torch.randn(2, 3, 32, 32)
    rec = tmp_path / "r.txt"
    model = amct.create_compressed_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], str(cfg), str(rec))
    model.train()
    model(x).square().mean().backward()
    model.eval()
    model(x)
    before = rec.stat()
    amct.save_compressed_retrain_model(model, str(rec), str(tmp_path / "a"), x[:1])
    after = rec.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    text = rec.read_text()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(x).square().mean().backward()
    opt.step()
    amct.save_compressed_retrain_model(model, str(rec), str(tmp_path / "b"), x[:1])
    assert rec.stat().st_ino != before.st_ino and rec.read_text() != text
    rec.unlink()  # gone: written again even though nothing changed
    amct.save_compressed_retrain_model(model, str(rec), str(tmp_path / "c"), x[:1])
    assert rec.is_file()
