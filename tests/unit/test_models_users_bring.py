"""What third-party model code needs from a compressed model: layers that are still
what they were, Hugging Face's Conv1D, parametrized weights, keyword inputs and structured
outputs with the same names in both files, and a capture that leaves nothing behind."""

import logging
import pickle

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import openamct as amct
from openamct.compressed.layer import CompressedLayer
from tests.acceptance.conftest import INT8_CFG, write_cfg

NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 0 } } }\n"
FILTER = "prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 ascend_optimized: false } } }\n"


class MyConv(nn.Conv2d):
    """A user's own subclass, as model zoos define them."""


class TFPadNet(nn.Module):
    """Reads its conv's attributes and class in forward, as HF MobileNet's apply_tf_padding does."""

    def __init__(self):
        super().__init__()
        self.conv = MyConv(3, 8, 3, stride=2)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        assert isinstance(self.conv, (nn.Conv2d, MyConv))
        k, s = self.conv.kernel_size[0], self.conv.stride[0]
        pad = max(k - s, 0)
        x = F.relu(self.conv(F.pad(x, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))))
        assert isinstance(self.fc, nn.Linear) and self.fc.in_features == x.shape[1]
        return self.fc(x.mean((2, 3)))


def _ort(path, feeds):
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess, sess.run(None, feeds)


def test_compressed_and_exported_layers_are_still_their_class(tmp_path):
    x = torch.randn(2, 3, 16, 16)
    cfg = write_cfg(tmp_path, INT8_CFG)
    m = amct.create_compressed_retrain_model(TFPadNet(), x, cfg, str(tmp_path / "r.txt"))
    assert isinstance(m.conv, CompressedLayer) and isinstance(m.conv, MyConv) and isinstance(m.fc, nn.Linear)
    assert (m.conv.kernel_size, m.conv.stride, m.conv.out_channels) == ((3, 3), (2, 2), 8)
    m.train()
    m(x).sum().backward()
    m.eval()
    with torch.no_grad():
        ref = m(x).numpy()
    assert isinstance(pickle.loads(pickle.dumps(m.conv)), MyConv)  # generated classes pickle by name
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "m"), x)
    _, (fake,) = _ort(str(tmp_path / "m_fake_quant_model.onnx"), {"x": x.numpy()})
    np.testing.assert_allclose(fake, ref, rtol=1e-4, atol=1e-4)


def _gpt2():
    import transformers as T

    torch.manual_seed(0)
    config = T.GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=4, n_positions=32, bos_token_id=1,
                          eos_token_id=2, attn_implementation="eager")
    return T.GPT2Model(config).eval()


def test_hf_conv1d_is_quantized_sparsified_and_runs_as_integer_gemm(tmp_path):
    from transformers.pytorch_utils import Conv1D

    ids = torch.randint(3, 50, (2, 8))
    feeds = {"input_ids": ids}
    cfg = write_cfg(tmp_path, INT8_CFG + NM)
    m = amct.create_compressed_retrain_model(_gpt2(), feeds, cfg, str(tmp_path / "r.txt"))
    layers = {n: mod for n, mod in m.named_modules() if isinstance(mod, CompressedLayer)}
    assert len(layers) == 4 and all(isinstance(mod, Conv1D) for mod in layers.values())
    m.eval()
    with torch.no_grad():
        ref = m(**feeds).last_hidden_state.numpy()
    c_fc = m.h[0].mlp.c_fc
    mask = c_fc.sparsity.mask  # [in, out]: groups of 4 along the input axis keep 2
    assert mask.shape == c_fc.weight.shape and torch.all(mask.reshape(-1, 4, mask.shape[1]).sum(1) == 2)
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "g"), feeds)
    _, (fake,) = _ort(str(tmp_path / "g_fake_quant_model.onnx"), {"input_ids": ids.numpy()})
    a, b = fake.ravel().astype(np.float64), ref.ravel()
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.9999
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(tmp_path / "g_deploy_model.onnx"), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
    assert ops.count("QGemm") == 4 and "Gemm" not in ops, sorted(set(ops))


def test_hf_conv1d_loses_output_channels_and_its_consumer_the_inputs(tmp_path):
    ids = torch.randint(3, 50, (2, 8))
    cfg = write_cfg(tmp_path, INT8_CFG + FILTER)
    m = amct.create_compressed_retrain_model(_gpt2(), {"input_ids": ids}, cfg, str(tmp_path / "r.txt"))
    mlp = m.h[0].mlp
    assert mlp.c_fc.nf == mlp.c_fc.weight.shape[1] == 64 and mlp.c_proj.weight.shape[0] == 64  # 128 -> 64
    m.eval()
    assert torch.isfinite(m(input_ids=ids).last_hidden_state).all()


def test_parametrized_weight_is_compressed_with_it_evaluated(tmp_path):
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 8, 3)), nn.ReLU(), nn.Conv1d(8, 2, 1))
    x = torch.randn(2, 4, 10)
    cfg = write_cfg(tmp_path, INT8_CFG)
    m = amct.create_compressed_retrain_model(model, x, cfg, str(tmp_path / "r.txt"))
    assert isinstance(m[0], CompressedLayer) and torch.nn.utils.parametrize.is_parametrized(model[0])
    model(x)  # the caller's model still works: its parametrization untouched
    m.eval()
    with torch.no_grad():
        out = m(x)
    torch.save(m.state_dict(), str(tmp_path / "c.pth"))
    r = amct.restore_compressed_retrain_model(model, x, cfg, str(tmp_path / "r.txt"), str(tmp_path / "c.pth"))
    r.eval()
    with torch.no_grad():
        assert torch.equal(r(x), out)


class KwargsDictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 4)

    def forward(self, **kwargs):
        return {"logits": self.a(kwargs["tokens"]) + self.b(kwargs["extra"]), "aux": self.b(kwargs["extra"]),
                "cache": None}


def test_keyword_inputs_and_dict_outputs_get_the_same_names_in_both_files(tmp_path):
    feeds = {"tokens": torch.randn(2, 6), "extra": torch.randn(2, 6)}
    cfg = write_cfg(tmp_path, INT8_CFG)
    m = amct.create_compressed_retrain_model(KwargsDictNet(), feeds, cfg, str(tmp_path / "r.txt"))
    m.eval()
    m(**feeds)
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "k"), feeds)
    for kind in ("fake_quant", "deploy"):
        g = onnx.load(str(tmp_path / f"k_{kind}_model.onnx")).graph
        assert [i.name for i in g.input] == ["tokens", "extra"], kind
        assert [o.name for o in g.output] == ["logits", "aux"], kind
        assert {t.name for t in g.initializer} >= {"a.bias"} or kind == "deploy", kind


class CachingNet(nn.Module):
    """Fills a cache and a counter in eval mode, as some Hugging Face modules do."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if not self.training:
            self.cache = x.detach()
            self.calls += 1
        return self.conv(x)


def test_the_capture_run_leaves_nothing_in_the_returned_model(tmp_path):
    x = torch.randn(1, 3, 8, 8)
    m = amct.create_compressed_retrain_model(CachingNet(), x, write_cfg(tmp_path, INT8_CFG), str(tmp_path / "r.txt"))
    assert not hasattr(m, "cache") and int(m.calls) == 0 and m.training


def test_one_warning_per_reason_not_per_layer(tmp_path, caplog):
    import transformers as T

    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                    intermediate_size=64, attn_implementation="eager"))
    ids = torch.randint(3, 50, (1, 8))
    with caplog.at_level(logging.WARNING, logger="openamct"):
        amct.create_compressed_retrain_model(bert, {"input_ids": ids}, write_cfg(tmp_path, INT8_CFG + FILTER),
                                             str(tmp_path / "r.txt"))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # residual adds (6 groups) and the pooler output: 2 reasons; q/k/v heads are pruned whole
    assert len(lines) <= 3, lines
    assert any("add combines the channels" in msg and ": 6:" in msg for msg in lines), lines
    assert not any("view" in msg for msg in lines), lines
    assert not any("Dropout" in msg for msg in lines), lines


def test_a_prune_config_that_removes_nothing_says_why(tmp_path, caplog):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))  # 8 channels, aligned to 16: whole
    cfg = write_cfg(tmp_path, FILTER.replace("ascend_optimized: false", "ascend_optimized: true"))
    with caplog.at_level(logging.WARNING, logger="openamct"):
        amct.create_prune_retrain_model(model, torch.randn(1, 3, 8, 8), cfg, str(tmp_path / "r.txt"))
    assert any("removes no channel" in r.getMessage() and "ascend_optimized" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


def test_inspect_takes_keyword_inputs(tmp_path, capsys, monkeypatch):
    from openamct.cli import main

    (tmp_path / "zoo_factory.py").write_text(
        "import torch\nfrom tests.unit.test_models_users_bring import KwargsDictNet\n"
        "def net():\n    return KwargsDictNet()\n"
        "def with_inputs():\n    return KwargsDictNet(), {'tokens': torch.randn(1, 6), 'extra': torch.randn(1, 6)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = write_cfg(tmp_path, INT8_CFG)
    assert main(["inspect", "--model", "zoo_factory:net", "--input", "tokens:float32:1,6",
                 "--input", "extra:float32:1,6", "--config", cfg]) == 0
    first = capsys.readouterr().out
    assert main(["inspect", "--model", "zoo_factory:with_inputs", "--config", cfg]) == 0
    second = capsys.readouterr().out
    assert "a " in first and first == second
    with pytest.raises(SystemExit):
        main(["inspect", "--model", "zoo_factory:with_inputs", "--input-shape", "1,6", "--config", cfg])
