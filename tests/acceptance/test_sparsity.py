"""2:4 acceptance: 2:4 in every saved ONNX, combined with INT8, accuracy, upstream configs."""

import os

import numpy as np
import pytest
import torch

import openamct as amct
from tests.acceptance._digits import digits_data, retrain, trained_fp32
from tests.acceptance.conftest import INT8_CFG as INT8
from tests.acceptance.conftest import int8_initializers, ort_run
from tests.acceptance.conftest import write_cfg as write
from tests.acceptance.onnx_weights import group_nonzeros, layer_weights
from tests.conftest import COMPAT
from tests.models import MODELS, example_input
from tests.numerics import assert_same_quantized_function
from tests.training import sgd_steps

NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: %d } } }\n"


def assert_two_four(path, min_layers):
    checked = 0
    for name, w, axis in layer_weights(path):
        if w.shape[axis] < 4:
            continue  # Cin <= 2 per group / depthwise: dense by design
        nnz = group_nonzeros(w, axis)
        assert nnz.max() <= 2, f"{path}: {name} has a group of 4 with {nnz.max()} non-zeros"
        if w.shape[axis] % 4 == 0:
            assert np.mean(w == 0) >= 0.5 - 1e-9, f"{name}: {np.mean(w == 0):.3f} zeros"
            assert np.mean(nnz == 2) > 0.99  # exactly 50%: two kept per group (zero weights are rare)
        checked += 1
    assert checked >= min_layers


def train(model, x, steps=3):
    sgd_steps(model, x, steps, lr=0.01)
    model.eval()
    model(x)


@pytest.mark.parametrize("name,layers", [("MobileNetV2Tiny", 6), ("UNetTiny", 4), ("TinyTransformerBlock", 6)])
@pytest.mark.parametrize("quant", [False, True])
def test_saved_onnx_is_two_four(tmp_path, name, layers, quant):
    x = example_input(name)
    batch = torch.cat([example_input(name, seed=s) for s in range(4)])
    rec = str(tmp_path / "rec.txt")
    text = NM % 0 + (INT8 if quant else "")
    create = amct.create_compressed_retrain_model if quant else amct.create_prune_retrain_model
    model = create(MODELS[name](), x, write(tmp_path, text), rec)
    train(model, batch)
    if quant:
        amct.save_compressed_retrain_model(model, rec, str(tmp_path / "m"), x)
    else:
        amct.save_prune_retrain_model(model, str(tmp_path / "m"), x)
    fake, deploy = str(tmp_path / "m_fake_quant_model.onnx"), str(tmp_path / "m_deploy_model.onnx")
    assert_two_four(fake, layers)
    assert_two_four(deploy, layers)
    if quant:
        assert int8_initializers(deploy)
    else:
        assert open(fake, "rb").read() == open(deploy, "rb").read()
    # 16 example inputs through the file saved for x's shape: with INT8, one input may differ by a
    # rounding-midpoint flip of a quantizer on another CPU (seen: UNetTiny trained from other
    # weights failed allclose on its one input), so that case is held to
    # assert_same_quantized_function (most elements to float noise, all within a flip).
    inputs = [example_input(name, seed=s) for s in range(16)]
    with torch.no_grad():
        y = np.concatenate([model(i).numpy() for i in inputs])
    out = np.concatenate([ort_run(fake, i) for i in inputs])
    if quant:
        assert_same_quantized_function(y, out, what=name)
    else:  # float only: nothing to flip
        assert np.allclose(out, y, atol=1e-4 * max(1.0, float(np.abs(y).max())))


def test_two_four_and_int8_accuracy_on_digits(tmp_path):
    fp32, acc_fp32 = trained_fp32()
    d = digits_data()
    sparse = amct.create_prune_retrain_model(fp32, d.x_train[:1], write(tmp_path, NM % 0), str(tmp_path / "r1.txt"))
    acc_sparse = retrain(sparse, epochs=4, lr=1e-3)
    # Paired on the same 450 test digits. Over 6 (seed, thread count) pairs, which land on other
    # weights as other CPUs do: -2..+1 digits against FP32, 2:4 alone and with INT8. The bounds
    # allow 4 and 6 fewer.
    assert acc_sparse >= acc_fp32 - 0.01, (acc_sparse, acc_fp32)
    both = amct.create_compressed_retrain_model(fp32, d.x_train[:1], write(tmp_path, NM % 0 + INT8), str(tmp_path / "r2.txt"))
    acc_both = retrain(both, epochs=4, lr=1e-3)
    assert acc_both >= acc_fp32 - 0.015, (acc_both, acc_fp32)
    amct.save_compressed_retrain_model(both, str(tmp_path / "r2.txt"), str(tmp_path / "d"), d.x_train[:1])
    assert_two_four(str(tmp_path / "d_deploy_model.onnx"), 2)


NM_CONFIGS = ["single_file__test_selective_prune__model_001_prune.cfg",
              "single_file__test_selective_prune__model_002_prune.cfg",
              "single_file__test_prune_interface__model_003_prune.cfg"]


@pytest.mark.parametrize("cfg", NM_CONFIGS)
def test_upstream_two_four_configs_create_restore_save(tmp_path, cfg):
    path = os.path.join(COMPAT, "configs", cfg)
    x = torch.randn(4, 2, 28, 28)
    rec, ck = str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")
    model = amct.create_prune_retrain_model(MODELS["Net001"](), x[:1], path, rec)
    train(model, x)
    y = model(x)
    torch.save({"state_dict": model.state_dict()}, ck)
    restored = amct.restore_prune_retrain_model(MODELS["Net001"](), x[:1], rec, path, ck, "state_dict")
    restored.eval()
    assert torch.allclose(restored(x), y, atol=1e-5)
    amct.save_prune_retrain_model(restored, str(tmp_path / "net"), x)
    assert_two_four(str(tmp_path / "net_deploy_model.onnx"), 4)
    if "model_003" in cfg:  # filter override on layer1.0 next to global 2:4: both applied
        assert restored.layer1[0].weight.shape[0] < 16
