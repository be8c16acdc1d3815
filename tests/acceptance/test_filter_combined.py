"""Acceptance: channel pruning across coupled layers and the full prune -> 2:4 -> INT8 flow."""

import logging
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import openamct as amct
from openamct.record.file_io import read_record
from tests.acceptance._digits import digits_data, retrain, trained_fp32
from tests.acceptance.conftest import INT8_CFG as INT8
from tests.acceptance.conftest import int8_initializers, ort_run
from tests.acceptance.conftest import write_cfg as write
from tests.acceptance.onnx_weights import group_nonzeros, layer_weights
from tests.conftest import COMPAT
from tests.models import MODELS, example_input
from tests.numerics import (
    assert_logits_agree,
    assert_same_quantized_function,
    cosine,
    skip_unless_exact_int8_kernels,
)

FILTER = "prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: %s ascend_optimized: false } } }\n"
NM_OVERRIDE = ('override_layer_configs { layer_name: "%s" prune_config { n_out_of_m_pruner { '
               'l1_selective_prune { update_freq: 0 } } } }\n')
# One prune technique per layer (prune_config is a oneof): channels are removed from the rest,
# and the 2:4 layer is sparsified on what remains of its input channels.
NM_LAYER = {"MobileNetV2Tiny": "features.4.0", "UNetTiny": "dec.0", "ResBlockNet": "head", "DigitsNet": "conv3"}


def digits_images(shape, n=64, offset=0):
    """Real digits and labels, resized and repeated to a model's input layout [n, C, H, W]."""
    d = digits_data()
    x = d.x_train[offset:offset + n]
    x = F.interpolate(x, size=shape[-2:], mode="bilinear", align_corners=False)
    return x.repeat(1, shape[1], 1, 1), d.y_train[offset:offset + n]


def task_loss(out, x, y):
    """Classify the digit, or (dense outputs) reconstruct the image."""
    if out.dim() == 2:
        return F.cross_entropy(out, y)
    return F.mse_loss(out, x[:, : out.shape[1]])


def train(model, x, y=None, steps=8, lr=0.01):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    for i in range(steps):
        sl = slice((i * 16) % len(x), (i * 16) % len(x) + 16)
        out = model(x[sl])
        loss = out.square().mean() if y is None else task_loss(out, x[sl], y[sl])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def channels(model, name):
    m = model.get_submodule(name)
    return getattr(m, "out_channels", getattr(m, "out_features", None))


@pytest.mark.parametrize("api,cfg", [
    ("prune", "configuration__net_001_prune_complete.cfg"),
    ("compressed", "configuration__net_001_prune_complete.cfg"),
    ("compressed", "configuration__compressed_cfg__net_001_compressed_quant_only_override_layer_configs.cfg"),
    ("compressed", "single_file__test_prune_interface__model_002_compressed.cfg"),
    ("compressed", "configuration__compressed_cfg__net_001_compressed_complete.cfg"),
    ("compressed", "configuration__compressed_cfg__net_001_compressed_quant_only_complete.cfg"),
    ("compressed", "configuration__compressed_cfg__net_001_compressed_quant_only_data_weight.cfg"),
    ("compressed", "configuration__compressed_cfg__net_001_compressed_quant_only_data_weight_nochannelwise.cfg"),
    ("compressed", "single_file__test_prune_interface__model_001_compressed.cfg"),
    ("compressed", "single_file__test_prune_interface__net_001_compressed_complete.cfg"),
    ("compressed", "single_file__test_selective_prune__net_001_compressed_complete.cfg"),
    ("compressed", "configuration__net_001_prune_has_quant.cfg"),
])
def test_net001_compat_configs_full_cycle(tmp_path, api, cfg):
    path = os.path.join(COMPAT, "configs", cfg)
    x = torch.randn(32, 2, 28, 28)  # 8 to train on; all 32 compared (see the ONNX check)
    rec, ck = str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")
    create = amct.create_prune_retrain_model if api == "prune" else amct.create_compressed_retrain_model
    model = create(MODELS["Net001"](), x[:1], path, rec)
    if cfg.endswith("prune_complete.cfg"):
        assert channels(model, "layer1.0") == 16 and channels(model, "layer2.0") < 16
        assert channels(model, "fc.0") == 1024 and channels(model, "fc.2") == 128
    if "override_layer_configs" in cfg:
        assert channels(model, "layer1.0") == 16  # 16 - 8 = 8 kept, aligned up to 16: too small
    train(model, x[:8], steps=3)
    with torch.no_grad():
        y = model(x)
    torch.save({"state_dict": model.state_dict()}, ck)
    if api == "prune":
        restored = amct.restore_prune_retrain_model(MODELS["Net001"](), x[:1], rec, path, ck, "state_dict")
    else:
        restored = amct.restore_compressed_retrain_model(MODELS["Net001"](), x[:1], path, rec, ck, "state_dict")
    restored.eval()
    with torch.no_grad():
        y2 = restored(x)
    assert y2.shape == (32, 10) and torch.allclose(y, y2, atol=1e-5)
    if api == "prune":
        amct.save_prune_retrain_model(restored, str(tmp_path / "n"), x)
    else:
        amct.save_compressed_retrain_model(restored, rec, str(tmp_path / "n"), x)
    fake, deploy = str(tmp_path / "n_fake_quant_model.onnx"), str(tmp_path / "n_deploy_model.onnx")
    if cfg.endswith("prune_complete.cfg"):  # prune-only, through either API: two identical files
        assert not read_record(rec).record
        assert open(fake, "rb").read() == open(deploy, "rb").read()
        assert np.allclose(ort_run(fake, x), y.numpy(), atol=1e-4)  # float only: no quantizer to flip
    else:
        assert read_record(rec).record and open(fake, "rb").read() != open(deploy, "rb").read()
        # Was allclose(atol=1e-4) on 8 samples, which one rounding-midpoint flip (a conv's last bit
        # differing between oneDNN and ORT, on some CPU or some trained weights) fails. Now: most
        # samples to float noise, every one within a flip; a wrong scale or zero point moves them all.
        assert_same_quantized_function(y.numpy(), ort_run(fake, x), what=cfg)


@pytest.mark.parametrize("name", ["MobileNetV2Tiny", "UNetTiny", "ResBlockNet"])
def test_prune_two_four_int8_train_restore_export_agree(tmp_path, name):
    shape = example_input(name).shape
    x, y_true = digits_images(shape, n=256)
    rec, ck = str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")
    cfg = write(tmp_path, FILTER % "0.3" + NM_OVERRIDE % NM_LAYER[name] + INT8)
    torch.manual_seed(0)
    original = MODELS[name]()
    train(original, x, y_true, steps=60, lr=0.05)  # a trained float model, as users bring
    params0 = sum(p.numel() for p in original.parameters())
    model = amct.create_compressed_retrain_model(original, x[:1], cfg, rec)
    assert sum(p.numel() for p in model.parameters()) < params0
    nm_layer = model.get_submodule(NM_LAYER[name])
    assert nm_layer.sparsity is not None
    train(model, x, y_true, steps=16)
    x = x[:64]
    assert nm_layer.weight.shape[1] < MODELS[name]().get_submodule(NM_LAYER[name]).weight.shape[1]
    with torch.no_grad():
        y = model(x)
    torch.save({"state_dict": model.state_dict()}, ck)
    restored = amct.restore_compressed_retrain_model(MODELS[name](), x[:1], cfg, rec, ck, "state_dict")
    restored.eval()
    with torch.no_grad():
        assert torch.allclose(restored(x), y, atol=1e-5)
    amct.save_compressed_retrain_model(restored, rec, str(tmp_path / "m"), x)
    assert int8_initializers(str(tmp_path / "m_deploy_model.onnx"))
    nm_shape = tuple(restored.get_submodule(NM_LAYER[name]).weight.shape)
    sparse = [(w, axis) for _, w, axis in layer_weights(str(tmp_path / "m_deploy_model.onnx")) if w.shape == nm_shape]
    assert sparse and all(group_nonzeros(w, axis).max() <= 2 for w, axis in sparse)
    fake = ort_run(str(tmp_path / "m_fake_quant_model.onnx"), x)
    skip_unless_exact_int8_kernels()
    deploy = ort_run(str(tmp_path / "m_deploy_model.onnx"), x)
    # The deploy graph rounds differently by design (int32 biases, re-quantised outputs), and the
    # barely trained float model (11-60 % accuracy, on CPU-dependent weights) has samples with
    # top-2 margins of 0.01 on logits spanning 8: "argmax agrees on >= 99 %" failed for 7 of 24
    # (seed, thread count) pairs here, as on the Intel CI. So the noise is bounded relative to the
    # logit range (measured <= 0.017; a weight scale 5 % off in one layer fails this or the
    # cosine, a wrong bias scale both), and argmax is compared where the margin beats twice that
    # noise, which has to be a quarter of the samples (measured >= 58 %).
    assert cosine(fake, deploy) >= 0.999  # measured >= 0.9998, UNetTiny's dense output included
    if fake.ndim == 2:
        assert_logits_agree(fake, deploy, max_rel_diff=0.04, min_decisive=0.25, what=name)


def test_prune_two_four_int8_accuracy_on_digits(tmp_path):
    fp32, acc_fp32 = trained_fp32()
    d = digits_data()
    cfg = write(tmp_path, FILTER % "0.3" + NM_OVERRIDE % NM_LAYER["DigitsNet"] + INT8 + 'regular_prune_skip_types: "Linear"\n')
    model = amct.create_compressed_retrain_model(fp32, d.x_train[:1], cfg, str(tmp_path / "rec.txt"))
    assert channels(model, "conv2") < 64
    acc = retrain(model, epochs=5, lr=1e-3)
    # Paired on the same 450 test digits. Over 6 (seed, thread count) pairs, which land on other
    # weights as other CPUs do: -2..+1 digits against FP32. The bound allows 4 fewer.
    assert acc >= acc_fp32 - 0.01, (acc, acc_fp32)


def test_record_from_another_model_or_shape_is_refused(tmp_path):
    x = example_input("MobileNetV2Tiny")
    cfg = write(tmp_path, FILTER % "0.5")
    rec = str(tmp_path / "rec.txt")
    model = amct.create_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x, cfg, rec)
    ck = str(tmp_path / "ck.pth")
    torch.save(model.state_dict(), ck)
    with pytest.raises(ValueError, match="record"):
        amct.restore_prune_retrain_model(MODELS["UNetTiny"](), example_input("UNetTiny"), rec, cfg, ck)
    text = open(rec).read()
    end_attr = text.index('name: "end"')
    i_pos = text.index("i:", end_attr)
    eol = text.index("\n", i_pos)
    open(rec, "w").write(text[:i_pos] + "i: 999" + text[eol:])
    with pytest.raises(ValueError, match=r"features\.\S+|prune_record\[\d+\]"):
        amct.restore_prune_retrain_model(MODELS["MobileNetV2Tiny"](), x, rec, cfg, ck)


def test_unhandled_group_is_logged_not_fatal(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    x = example_input("TinyTransformerBlock")
    model = amct.create_prune_retrain_model(MODELS["TinyTransformerBlock"](), x, write(tmp_path, FILTER % "0.5"),
                                            str(tmp_path / "rec.txt"))
    assert channels(model, "q_proj") == 32 and channels(model, "fc1") == 32  # MLP hidden 64 -> 32
    assert "not pruned" in caplog.text and "q_proj" in caplog.text
    assert model(x).shape == x.shape


def test_restore_replays_the_record_and_never_scores(tmp_path, monkeypatch):
    # Output equality cannot tell replay from re-scoring (the checkpoint overwrites every weight),
    # so scoring is made to fail during restore, and restore runs on a model with other weights.
    path = os.path.join(COMPAT, "configs", "configuration__net_001_prune_complete.cfg")
    x = torch.randn(4, 2, 28, 28)
    rec, ck = str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")
    torch.manual_seed(0)
    model = amct.create_compressed_retrain_model(MODELS["Net001"](), x[:1], path, rec)
    model.eval()
    with torch.no_grad():
        y = model(x)
    torch.save({"state_dict": model.state_dict()}, ck)

    def no_scoring(*args, **kwargs):
        raise AssertionError("restore re-scored channels instead of replaying the record")

    monkeypatch.setattr("openamct.sparsity.filter.score_and_select", no_scoring)
    torch.manual_seed(123)  # different original weights would score differently
    restored = amct.restore_compressed_retrain_model(MODELS["Net001"](), x[:1], path, rec, ck, "state_dict")
    restored.eval()
    with torch.no_grad():
        assert torch.allclose(restored(x), y, atol=1e-5)
    with pytest.raises(AssertionError, match="re-scored"):  # the patch is live: create does score
        amct.create_compressed_retrain_model(MODELS["Net001"](), x[:1], path, str(tmp_path / "rec2.txt"))
