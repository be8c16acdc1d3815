"""Acceptance of INT8 QAT: create -> train -> restore -> save, fake-quant and deploy ONNX."""

import os

import numpy as np
import pytest
import torch

import openamct as amct
from tests.acceptance._digits import digits_data, retrain, trained_fp32
from tests.acceptance.conftest import INT8_CFG as QUANT_CFG
from tests.acceptance.conftest import int8_initializers, ort_run
from tests.acceptance.conftest import write_cfg as write
from tests.conftest import COMPAT
from tests.models import MODELS, example_input
from tests.numerics import (
    assert_logits_agree,
    assert_same_quantized_function,
    skip_unless_exact_int8_kernels,
)
from tests.training import sgd_steps


def train_steps(model, x, steps=4):
    sgd_steps(model, x, steps, lr=0.01, momentum=0.9)


@pytest.mark.parametrize("name,batch", [("ResBlockNet", (16, 3, 16, 16)), ("TinyTransformerBlock", (16, 8, 32))])
def test_lifecycle_restore_is_exact_and_exports(tmp_path, name, batch):
    torch.manual_seed(0)
    x = torch.randn(*batch)
    cfg, rec, ck = write(tmp_path, QUANT_CFG), str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")
    model = amct.create_compressed_retrain_model(MODELS[name](), example_input(name), cfg, rec)
    train_steps(model, x)
    model.eval()
    with torch.no_grad():
        y = model(x)
    torch.save({"state_dict": model.state_dict()}, ck)
    restored = amct.restore_compressed_retrain_model(MODELS[name](), example_input(name), cfg, rec, ck, "state_dict")
    restored.eval()
    with torch.no_grad():
        y2 = restored(x)
    assert y2.shape == y.shape
    assert torch.allclose(y, y2, atol=1e-5)
    amct.save_compressed_retrain_model(restored, rec, str(tmp_path / "m"), x)
    fake, deploy = str(tmp_path / "m_fake_quant_model.onnx"), str(tmp_path / "m_deploy_model.onnx")
    # Was ">= 99 % of elements within 16 ulps": a rounding-midpoint flip moves all 10 logits of its
    # sample (6 % of ResBlockNet's 16 x 10), and how often one happens depends on the CPU. Now:
    # most elements to float noise, every one within a flip; a wrong scale moves them all.
    assert_same_quantized_function(y.numpy(), ort_run(fake, x), what=name)
    assert int8_initializers(deploy)
    rec_text = open(rec).read()
    assert "scale_d" in rec_text and "scale_w" in rec_text


def test_qat_on_digits_within_one_point_of_fp32(tmp_path):
    fp32, acc_fp32 = trained_fp32()
    d = digits_data()
    cfg, rec = write(tmp_path, QUANT_CFG), str(tmp_path / "rec.txt")
    model = amct.create_compressed_retrain_model(fp32, d.x_train[:1], cfg, rec)
    acc = retrain(model, epochs=3, lr=5e-4)
    # Paired on the same 450 test digits. Over 6 (seed, thread count) pairs, which land on other
    # weights as other CPUs do: +0 digits against FP32 every time (FP32 98.9-99.3 %). The bound
    # allows 4 fewer.
    assert acc >= acc_fp32 - 0.01, (acc, acc_fp32)
    amct.save_compressed_retrain_model(model, rec, str(tmp_path / "digits"), d.x_train[:1],
                                      dynamic_axes={"x": [0]})
    fake = ort_run(str(tmp_path / "digits_fake_quant_model.onnx"), d.x_test[:64])
    skip_unless_exact_int8_kernels()
    deploy = ort_run(str(tmp_path / "digits_deploy_model.onnx"), d.x_test[:64])
    # Was "cosine >= 0.999 and argmax agreement >= 0.99", which one digit with a top-2 margin
    # below the deploy graph's rounding noise fails. Measured over 6 (seed, thread count) pairs:
    # noise 0.0013-0.0017 of the logit range, >= 98 % of digits decisive, cosine >= 0.999998.
    # int32 biases 2 % off give 0.012 and cosine 0.99989; both bounds fail that.
    assert_logits_agree(fake, deploy, max_rel_diff=0.006, min_decisive=0.75, min_cosine=0.9999, what="digits")


QUANT_COMPAT = [
    "configuration__compressed_cfg__net_001_compressed_complete.cfg",
    "configuration__compressed_cfg__net_001_compressed_quant_only_complete.cfg",
    "configuration__compressed_cfg__net_001_compressed_quant_only_data_weight.cfg",
    "configuration__compressed_cfg__net_001_compressed_quant_only_data_weight_nochannelwise.cfg",
    "configuration__compressed_cfg__net_001_compressed_quant_only_override_layer_configs.cfg",
    "single_file__test_prune_interface__model_001_compressed.cfg",
    "single_file__test_prune_interface__model_002_compressed.cfg",
    "single_file__test_prune_interface__net_001_compressed_complete.cfg",
    "single_file__test_selective_prune__net_001_compressed_complete.cfg",
    # filter pruning + a quant override: refused by the prune API, the compressed API runs both halves
    "configuration__net_001_prune_has_quant.cfg",
]


@pytest.mark.parametrize("cfg", QUANT_COMPAT)
def test_every_compat_quant_config_creates_and_saves_on_net001(tmp_path, cfg):
    x = torch.randn(4, 2, 28, 28)
    rec = str(tmp_path / "rec.txt")
    model = amct.create_compressed_retrain_model(MODELS["Net001"](), x[:1], os.path.join(COMPAT, "configs", cfg), rec)
    train_steps(model, x, steps=2)
    model.eval()
    model(x)
    amct.save_compressed_retrain_model(model, rec, str(tmp_path / "net"), x)
    out = ort_run(str(tmp_path / "net_deploy_model.onnx"), x)
    assert out.shape == (4, 10) and np.isfinite(out).all()


def test_quant_family_json_config_round_trip(tmp_path):
    x = example_input("ResBlockNet")
    cfg_json, rec = str(tmp_path / "quant.json"), str(tmp_path / "rec.txt")
    amct.create_quant_retrain_config(cfg_json, MODELS["ResBlockNet"](), x)
    model = amct.create_quant_retrain_model(cfg_json, MODELS["ResBlockNet"](), rec, x)
    train_steps(model, torch.randn(8, 3, 16, 16), steps=2)
    ck = str(tmp_path / "ck.pth")
    torch.save(model.state_dict(), ck)
    restored = amct.restore_quant_retrain_model(cfg_json, MODELS["ResBlockNet"](), rec, x, ck)
    model.eval()
    restored.eval()
    assert torch.equal(model(x), restored(x))
    amct.save_quant_retrain_model(cfg_json, restored, rec, str(tmp_path) + "/", x)
    assert os.path.isfile(tmp_path / "fake_quant_model.onnx") and os.path.isfile(tmp_path / "deploy_model.onnx")


def test_save_before_any_forward_says_what_to_run(tmp_path):
    x = example_input("ResBlockNet")
    rec = str(tmp_path / "rec.txt")
    model = amct.create_compressed_retrain_model(MODELS["ResBlockNet"](), x, write(tmp_path, QUANT_CFG), rec)
    with pytest.raises(ValueError, match=r"not initialised yet: run the compressed model on real data first"):
        amct.save_compressed_retrain_model(model, rec, str(tmp_path / "m"), x)
    assert not os.path.exists(tmp_path / "m_deploy_model.onnx")


def test_checkpoint_of_another_model_is_refused(tmp_path):
    x = example_input("ResBlockNet")
    cfg, rec = write(tmp_path, QUANT_CFG), str(tmp_path / "rec.txt")
    amct.create_compressed_retrain_model(MODELS["ResBlockNet"](), x, cfg, rec)
    other = amct.create_compressed_retrain_model(MODELS["ResBlockNet"](c=32), x, cfg, str(tmp_path / "rec2.txt"))
    torch.save(other.state_dict(), str(tmp_path / "other.pth"))
    with pytest.raises(ValueError, match="does not match the compressed model.*shape mismatches"):
        amct.restore_compressed_retrain_model(MODELS["ResBlockNet"](), x, cfg, rec, str(tmp_path / "other.pth"))
