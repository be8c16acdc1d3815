"""2:4 through the public API: create -> train -> checkpoint -> restore, masks from the record."""

import logging

import pytest
import torch

import openamct as amct
from openamct.compressed.layer import CompressedLayer
from openamct.record.file_io import read_record
from openamct.record.mask_codec import pack_bits
from openamct.sparsity.nm import compute_nm_mask
from openamct.techniques.sparsity24 import masks_in_record
from tests.models import MODELS, example_input
from tests.training import sgd_steps


def cfg(tmp_path, update_freq):
    p = tmp_path / "nm.cfg"
    p.write_text("prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 "
                 f"update_freq: {update_freq} }} }} }}\n")
    return str(p)


def train(model, x, steps=3, lr=0.05):
    sgd_steps(model, x, steps, lr=lr)


def layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, CompressedLayer)}


def test_update_freq_0_masks_fixed_and_restored_from_record(tmp_path):
    x = torch.randn(8, 3, 32, 32)
    rec, ck = str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")
    model = amct.create_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], cfg(tmp_path, 0), rec)
    train(model, x, steps=1)
    first = {n: m.sparsity.mask.clone() for n, m in layers(model).items()}
    train(model, x, steps=4, lr=0.5)
    drifted = 0
    for n, m in layers(model).items():
        assert torch.equal(m.sparsity.mask, first[n])
        drifted += int(not torch.equal(compute_nm_mask(m.weight.detach(), m.sparsity.axis), first[n]))
    assert drifted > 0  # the weights moved enough that recomputing would give other masks
    model.eval()
    y = model(x)
    torch.save({"state_dict": model.state_dict()}, ck)
    recorded = masks_in_record(read_record(rec))
    assert set(recorded) == set(first)
    restored = amct.restore_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], rec, cfg(tmp_path, 0), ck, "state_dict")
    restored.eval()
    assert torch.allclose(restored(x), y, atol=1e-5)
    for n, m in layers(restored).items():
        assert torch.equal(m.sparsity.mask, first[n]) and torch.equal(recorded[n], first[n])


def test_restore_takes_masks_from_record_not_from_weights(tmp_path):
    x = torch.randn(4, 3, 32, 32)
    rec, ck = str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")
    model = amct.create_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], cfg(tmp_path, 0), rec)
    train(model, x, steps=2)
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith(("sparsity.mask_bits", "sparsity.mask_ready"))}
    torch.save(sd, ck)
    # the checkpoint lacks the masks: strict loading must tell so, not silently recompute them
    with pytest.raises(ValueError, match="missing keys.*sparsity.mask"):
        amct.restore_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], rec, cfg(tmp_path, 0), ck)


def test_checkpoint_masks_newer_or_older_than_the_record(tmp_path, caplog):
    # update_freq > 0: masks changed after the checkpoint and the record was rewritten. Restore
    # keeps the checkpoint's masks (they belong to its weights: the resume is exact), names the
    # layers, and does not rewrite the record until training goes on.
    x = torch.randn(4, 3, 32, 32)
    rec, ck = str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")
    model = amct.create_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], cfg(tmp_path, 0), rec)
    train(model, x, steps=2)
    model.eval()
    model(x)
    sd = model.state_dict()
    name = next(n for n in layers(model))
    key = f"{name}.sparsity.mask_bits"
    sp = layers(model)[name].sparsity
    other = sp.mask.flip(sp.axis)  # another valid 2:4 pattern
    assert not torch.equal(other, sp.mask)
    torch.save({"state_dict": {**sd, key: pack_bits(other)}}, ck)
    before = open(rec, "rb").read()
    recorded = masks_in_record(read_record(rec))
    with caplog.at_level(logging.WARNING, logger="openamct"):
        restored = amct.restore_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], rec, cfg(tmp_path, 0), ck,
                                                    "state_dict")
    masks = {n: m.sparsity.mask.bool() for n, m in layers(restored).items()}
    assert torch.equal(masks[name], other.bool())
    assert all(torch.equal(masks[n], recorded[n]) for n in masks if n != name)
    assert any(name in r.getMessage() and "checkpoint" in r.getMessage() for r in caplog.records), caplog.text
    restored.eval()
    restored(x)
    assert open(rec, "rb").read() == before  # restoring and evaluating leave the record alone
    train(restored, x, steps=1)
    restored.eval()
    restored(x)  # eval after training: the record now holds the model's masks
    assert torch.equal(masks_in_record(read_record(rec))[name], other.bool())


def test_update_freq_1_masks_follow_the_weights(tmp_path):
    x = torch.randn(8, 3, 32, 32)
    model = amct.create_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], cfg(tmp_path, 1), str(tmp_path / "r.txt"))
    train(model, x, steps=1)
    first = {n: m.sparsity.mask.clone() for n, m in layers(model).items()}
    train(model, x, steps=6, lr=0.5)
    changed = 0
    for n, m in layers(model).items():
        model.train()
        expected = compute_nm_mask(m.weight.detach(), m.sparsity.axis)
        # the mask is recomputed at the start of each training forward, before that step's update
        assert (m.sparsity.mask != expected).float().mean() < 0.2
        changed += int(not torch.equal(m.sparsity.mask, first[n]))
    assert changed > 0
    recorded = masks_in_record(read_record(str(tmp_path / "r.txt")))
    assert all(torch.equal(recorded[n], m.sparsity.mask) for n, m in layers(model).items())


def test_depthwise_and_small_cin_stay_dense_reused_left_alone(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    model = amct.create_prune_retrain_model(MODELS["Net001"](), example_input("Net001"), cfg(tmp_path, 0),
                                            str(tmp_path / "r.txt"))
    wrapped = layers(model)
    assert "layer1.0" not in wrapped  # Cin = 2
    assert "layer3.0" not in wrapped and "layer4.0" not in wrapped  # depthwise
    assert {"layer2.0", "layer5.0", "layer6.0", "fc.0", "fc.2", "fc.5"} <= set(wrapped)
    reused = amct.create_prune_retrain_model(MODELS["ReusedModuleNet"](), example_input("ReusedModuleNet"),
                                             cfg(tmp_path, 0), str(tmp_path / "r2.txt"))
    assert set(layers(reused)) == {"stem"}  # the reused "shared" is left alone, the rest still pruned
    assert "called 2 times" in caplog.text


def test_record_mask_of_wrong_shape_names_the_layer(tmp_path):
    x = example_input("MobileNetV2Tiny")
    rec = str(tmp_path / "rec.txt")
    model = amct.create_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x, cfg(tmp_path, 0), rec)
    train(model, torch.randn(2, 3, 32, 32), steps=1)
    ck = str(tmp_path / "ck.pth")
    torch.save(model.state_dict(), ck)
    text = open(rec).read()
    first_shape = text.index("mask_shape")
    ints = text.index("ints:", first_shape)
    end = text.index("\n", ints)
    bad = text[:ints] + "ints: 999" + text[end:]
    open(rec, "w").write(bad)
    with pytest.raises(ValueError, match=r"selective_prune 'features\.\S+'"):
        amct.restore_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x, rec, cfg(tmp_path, 0), ck)


@pytest.mark.parametrize("old_dtype", [torch.float32, torch.bool])
def test_checkpoint_with_unpacked_masks_from_before_masks_were_packed_restores(tmp_path, old_dtype):
    """Masks are packed bits now; older checkpoints held float 0/1 masks, then bool ones, under
    ``<layer>.sparsity.mask``."""
    x = torch.randn(4, 3, 32, 32)
    rec, ck = str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")
    model = amct.create_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], cfg(tmp_path, 0), rec)
    train(model, x, steps=1)
    model.eval()
    y = model(x)
    sd = model.state_dict()
    masks = {f"{n}.sparsity.mask": m.sparsity.mask.to(old_dtype) for n, m in layers(model).items()}
    assert masks and all(k + "_bits" in sd for k in masks)
    torch.save({k: v for k, v in sd.items() if not k.endswith("sparsity.mask_bits")} | masks, ck)
    restored = amct.restore_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x[:1], rec, cfg(tmp_path, 0), ck)
    restored.eval()
    assert torch.equal(restored(x), y)
    assert all(torch.equal(m.sparsity.mask_bits, sd[f"{n}.sparsity.mask_bits"]) for n, m in layers(restored).items())
