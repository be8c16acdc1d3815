"""Inputs a user gets wrong or models users bring: each ends in one clear error naming the
argument, or just works, instead of a deep torch traceback."""

from __future__ import annotations

import os

import onnx
import pytest
import torch
from torch import nn

import openamct as amct
from tests.small import ConvFc, one_step, write_cfg


class Attention(nn.Module):
    """nn.MultiheadAttention takes its fused fast path under no_grad in eval mode."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.mha = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.mha(h, h, h, need_weights=False)
        return self.head(a + h).mean(dim=1)


def test_save_creates_the_output_folder_as_the_quick_start_expects(tmp_path):
    x = torch.randn(2, 3, 8, 8)
    m = one_step(tmp_path, ConvFc(), x)
    prefix = tmp_path / "out" / "deeper" / "resnet"
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(prefix), x)
    names = sorted(os.listdir(tmp_path / "out" / "deeper"))
    assert names == ["resnet_deploy_model.onnx", "resnet_fake_quant_model.onnx"]
    onnx.checker.check_model(str(tmp_path / "out" / "deeper" / "resnet_deploy_model.onnx"))


def test_save_refuses_a_folder_path_that_is_a_file(tmp_path):
    x = torch.randn(2, 3, 8, 8)
    m = one_step(tmp_path, ConvFc(), x)
    (tmp_path / "blocker").write_text("not a folder")
    with pytest.raises(ValueError, match=r"save_path .*blocker.* is a file, not a folder"):
        amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "blocker" / "net"), x)
    assert (tmp_path / "blocker").read_text() == "not a folder"


def test_save_with_input_data_of_the_wrong_shape_names_input_data(tmp_path):
    x = torch.randn(2, 3, 8, 8)
    m = one_step(tmp_path, ConvFc(), x)
    with pytest.raises(ValueError, match=r"^save_\*: input_data does not fit the model"):
        amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "net"), torch.randn(2, 5, 8, 8))
    assert not any(f.endswith(".onnx") for f in os.listdir(tmp_path))


def test_input_data_on_the_meta_device_is_refused_by_name(tmp_path):
    x = torch.randn(2, 3, 8, 8, device="meta")
    with pytest.raises(ValueError, match=r"input_data is on the meta device: give real sample values"):
        amct.create_compressed_retrain_model(ConvFc(), x, write_cfg(tmp_path), str(tmp_path / "r.txt"))
    assert not (tmp_path / "r.txt").exists()


def test_multihead_attention_saves_and_runs_in_onnxruntime(tmp_path):
    import onnxruntime as ort

    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    m = one_step(tmp_path, Attention(), x)
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "att"), x)
    fake, deploy = str(tmp_path / "att_fake_quant_model.onnx"), str(tmp_path / "att_deploy_model.onnx")
    with torch.no_grad():
        want = m(x)
    for path in (fake, deploy):
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        assert got.shape == tuple(want.shape)
    sess = ort.InferenceSession(fake, providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # the fast path stays as the user had it
    assert torch.backends.mha.get_fastpath_enabled()


def test_multihead_attention_raises_no_create_warning(tmp_path, caplog):
    x = torch.randn(2, 5, 8)
    with caplog.at_level("WARNING"):
        amct.create_compressed_retrain_model(Attention(), x, write_cfg(tmp_path), str(tmp_path / "r.txt"))
    assert not [r for r in caplog.records if "MultiheadAttention" in r.getMessage()]


class Encoder(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.enc = nn.TransformerEncoderLayer(d, 2, dim_feedforward=32, batch_first=True, dropout=0.0)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.enc(self.inp(x))).mean(dim=1)


def test_transformer_encoder_layer_saves_and_matches_in_onnxruntime(tmp_path):
    import onnxruntime as ort

    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    m = one_step(tmp_path, Encoder(), x)
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "enc"), x)
    with torch.no_grad():
        want = m(x)
    sess = ort.InferenceSession(str(tmp_path / "enc_fake_quant_model.onnx"), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    # Six quantized Linears in a row: an activation on a rounding boundary may land one grid
    # step apart in ORT's float order, so compare at a few grid steps, not bit for bit.
    assert torch.allclose(got, want, atol=5e-3), (got - want).abs().max()


class PairInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 4)

    def forward(self, pair):
        x, y = pair
        return self.a(x) + self.b(y)


def test_a_nested_tuple_input_is_exported_as_inputs_not_constants(tmp_path):
    import onnxruntime as ort

    torch.manual_seed(0)
    x, y = torch.randn(3, 6), torch.randn(3, 6)
    m = one_step(tmp_path, PairInput(), ((x, y),))
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "pair"), ((x, y),))
    x2, y2 = torch.randn(3, 6), torch.randn(3, 6)  # other values than the calibration batch
    with torch.no_grad():
        want = m((x2, y2))
    for kind in ("fake_quant", "deploy"):
        path = str(tmp_path / f"pair_{kind}_model.onnx")
        names = [i.name for i in onnx.load(path).graph.input]
        assert names == ["input_0_0", "input_0_1"], names
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        got = torch.from_numpy(sess.run(None, {"input_0_0": x2.numpy(), "input_0_1": y2.numpy()})[0])
        assert torch.allclose(got, want, atol=0.05), (kind, (got - want).abs().max())
    fake = ort.InferenceSession(str(tmp_path / "pair_fake_quant_model.onnx"), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(fake.run(None, {"input_0_0": x2.numpy(), "input_0_1": y2.numpy()})[0])
    assert torch.allclose(got, want, atol=1e-5)
