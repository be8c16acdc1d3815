"""Large models' 2:4 masks live in a mask file beside the record.

The threshold is lowered so a small model takes the large-model path; the demo-sized default
keeps masks inline (the golden test holds that)."""

import copy
import hashlib
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import openamct as amct
from openamct.compressed.layer import CompressedLayer
from openamct.record import attrs, sidecar
from openamct.record.file_io import read_record
from openamct.record.sidecar import FILE, FILE_SHA
from openamct.techniques import sparsity24
from openamct.techniques.sparsity24 import masks_in_record
from tests.models import MODELS
from tests.training import sgd_steps

CFG = ("retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
       "prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: UF } } }\n")


@pytest.fixture
def sidecar_always(monkeypatch):
    monkeypatch.setattr(sparsity24, "SIDECAR_MIN_WEIGHTS", 0)


def cfg(tmp_path, update_freq=0):
    p = tmp_path / "c.cfg"
    p.write_text(CFG.replace("UF", str(update_freq)))
    return str(p)


def sidecars(folder):
    return sorted(f for f in os.listdir(folder) if ".masks-" in f)


def prune_part(path):
    """The record's text from its first prune_record on (the 2:4 entries come after the scales)."""
    text = open(path, encoding="utf-8").read()
    return text[text.index("prune_record"):]


def trained(tmp_path, update_freq=0, steps=1):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    rec = str(tmp_path / "rec.txt")
    model = amct.create_compressed_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], cfg(tmp_path, update_freq), rec, large_model=True)
    sgd_steps(model, x, steps=steps)
    return model, x, rec


def test_masks_go_to_a_named_verified_file_and_eval_only_adds_scales(tmp_path, sidecar_always):
    model, x, rec = trained(tmp_path)
    model._openamct.wait()
    [side] = sidecars(tmp_path)
    text = open(rec, encoding="utf-8").read()
    assert "selective_mask" not in text and side in text and "mask_file_sha256" in text
    before, stat = prune_part(rec), os.stat(tmp_path / side)
    model.eval()
    y = model(x)
    after = open(rec, encoding="utf-8").read()
    assert after.split("prune_record")[0] != text.split("prune_record")[0]  # the trained scales went in ...
    assert prune_part(rec) == before  # ... the masks' entries are as they were ...
    assert sidecars(tmp_path) == [side]
    now = os.stat(tmp_path / side)
    assert (now.st_ino, now.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)  # ... and their file not rewritten
    masks = masks_in_record(read_record(rec), rec)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, CompressedLayer)}
    assert masks and all(torch.equal(masks[n], layers[n].sparsity.mask) for n in masks)
    ck = str(tmp_path / "ck.pth")
    torch.save(model.state_dict(), ck)
    restored = amct.restore_compressed_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], cfg(tmp_path), rec, ck, large_model=True)
    restored.eval()
    assert torch.allclose(restored(x), y, atol=1e-5)


@pytest.mark.parametrize("tamper", ["flip", "truncate", "missing"])
def test_a_changed_mask_file_is_refused_naming_it(tmp_path, sidecar_always, tamper):
    model, x, rec = trained(tmp_path)
    model.eval()
    model(x)
    ck = str(tmp_path / "ck.pth")
    torch.save(model.state_dict(), ck)
    path = tmp_path / sidecars(tmp_path)[0]
    data = bytearray(path.read_bytes())
    if tamper == "flip":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        match = "does not match the record"
    elif tamper == "truncate":
        path.write_bytes(bytes(data[:-8]))
        match = "cut short"
    else:
        path.unlink()
        match = "cannot be read"
    with pytest.raises(ValueError, match=match) as err:
        amct.restore_compressed_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], cfg(tmp_path), rec, ck, large_model=True)
    assert str(path) in str(err.value) and "rec.txt" in str(err.value)


def test_changed_masks_get_a_new_file_and_the_old_one_goes(tmp_path, sidecar_always):
    model, x, rec = trained(tmp_path, update_freq=1, steps=1)
    model._openamct.wait()
    first = sidecars(tmp_path)
    sgd_steps(model, x, steps=3, lr=0.5)  # big steps: recomputed masks change
    model._openamct.wait()
    second = sidecars(tmp_path)
    assert len(first) == len(second) == 1 and first != second
    assert second[0] in open(rec, encoding="utf-8").read()
    masks = masks_in_record(read_record(rec), rec)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, CompressedLayer)}
    assert all(torch.equal(masks[n], layers[n].sparsity.mask) for n in masks)


def test_small_models_keep_upstream_inline_masks(tmp_path):
    model, x, rec = trained(tmp_path)
    model._openamct.wait()
    assert "selective_mask" in open(rec, encoding="utf-8").read() and not sidecars(tmp_path)


def test_a_mask_file_needs_the_records_path(tmp_path, sidecar_always):
    model, x, rec = trained(tmp_path)
    model._openamct.wait()
    with pytest.raises(ValueError, match="record file's path"):
        masks_in_record(read_record(rec))


def test_the_mask_files_hash_is_left_to_the_writing_thread(tmp_path, sidecar_always, monkeypatch):
    """Training steps build the record; its mask file is hashed (up to 0.5 s at 1.1B
    parameters) on the thread that writes it, and the file and record still agree."""
    model, x, rec = trained(tmp_path, update_freq=1, steps=0)  # create writes (and hashes) on the caller's thread: not a step
    threads = []
    real = hashlib.sha256

    def spy(*data):
        threads.append(threading.current_thread().name)
        return real(*data)

    monkeypatch.setattr(sidecar, "hashlib", SimpleNamespace(sha256=spy))
    sgd_steps(model, x, steps=2)  # update_freq 1: new masks, so a new mask file, each step
    model._openamct.wait()
    assert threads and set(threads) == {"openamct-record"}
    [side] = sidecars(tmp_path)
    digest = real((tmp_path / side).read_bytes()).hexdigest()
    entries = [pr.selective_prune for pr in read_record(rec).prune_record
               if pr.HasField("selective_prune") and attrs.find(pr.selective_prune, FILE) is not None]
    assert entries and all(attrs.get_str(e, FILE_SHA) == digest and attrs.get_str(e, FILE) == side for e in entries)


def test_a_forward_that_recomputes_masks_waits_for_the_mask_file_in_writing(tmp_path, sidecar_always, monkeypatch):
    """The mask file is written from the live masks, not a copy (a copy was 1/32 of the weights
    in new pages in the first step): a forward due to recompute them waits until the write in
    flight is done, or the file would hold masks other than those its name and hash say."""
    from openamct.training import keeper

    model, x, rec = trained(tmp_path, update_freq=1, steps=0)
    checked = []
    real = keeper._write

    def slow(target, record, header, out, fast=None):
        time.sleep(0.3)  # the next step's forward, which recomputes every mask, comes meanwhile
        real(target, record, header, out, fast)
        for blob in out.blobs:
            path = tmp_path / sidecar.sidecar_name(os.path.basename(rec), blob.sha256)
            checked.append(hashlib.sha256(path.read_bytes()).hexdigest() == blob.sha256)

    monkeypatch.setattr(keeper, "_write", slow)
    sgd_steps(model, x, steps=3, lr=0.5)  # big steps: each recompute changes the masks
    model._openamct.wait()
    assert len(checked) >= 2 and all(checked)
    masks = masks_in_record(read_record(rec), rec)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, CompressedLayer)}
    assert all(torch.equal(masks[n], layers[n].sparsity.mask) for n in masks)


def test_load_state_dict_waits_for_the_mask_file_in_writing(tmp_path, sidecar_always, monkeypatch):
    from openamct.training import keeper

    model, x, rec = trained(tmp_path, steps=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    real = keeper._write
    monkeypatch.setattr(keeper, "_write", lambda *a: (time.sleep(0.3), real(*a)))
    sgd_steps(model, x, steps=1)  # computes the masks: their file is written in the background
    assert model._openamct._writer is not None
    model.load_state_dict(before)  # writes the masks in place: only once the file is written
    assert model._openamct._writer is None


def test_a_model_whose_masks_went_to_a_file_can_be_deep_copied_and_saved(tmp_path, sidecar_always):
    """The mask file's content stays cached in the model for the next write: it must copy
    as the rest of the model does (save takes working copies; users copy models too)."""
    model, x, rec = trained(tmp_path)
    model._openamct.wait()
    twin = copy.deepcopy(model)
    model.eval()
    twin.eval()
    with torch.no_grad():
        assert torch.equal(twin(x), model(x))
    amct.save_compressed_retrain_model(model, rec, str(tmp_path / "m"), x[:1])
    assert (tmp_path / "m_deploy_model.onnx").is_file()
