"""The matmul_quant technique (``quantize_activation_matmul: true``) quantizes both inputs of
attention's q @ k^T and softmax @ v in the training model, so ONNX Runtime runs both products
as integer kernels and the deploy model computes what the fake-quant model does."""

import collections

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.quant.matmul import MatMulQuant, matmul_quants
from openamct.record.file_io import read_record, write_record
from openamct.techniques.base import selective_algorithm
from openamct.techniques.matmul_quant import ALGORITHM
from tests.numerics import assert_same_quantized_function
from tests.runtimes import ort_optimized_ops
from tests.training import checkpoint_and_save

CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
"""
ON = CFG + "quantize_activation_matmul: true\n"


class Attention(nn.Module):
    """Swin-style attention: a fused qkv Linear, ``q.matmul(k^T)``, softmax, ``@ v``, a
    projection; plus a product with a parameter (not an activation x activation one)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mix = nn.Parameter(torch.randn(dim, dim) * 0.2)
        self.drop = nn.Dropout(0.0)
        self.fail = False  # raise after both products (a failed training forward)

    def forward(self, x):
        b, n, c = x.shape
        x = x @ self.mix
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * 0.35).matmul(k.transpose(-2, -1))
        attn = self.drop(attn.softmax(dim=-1))
        y = (attn @ v).transpose(1, 2).reshape(b, n, c)
        if self.fail:
            raise RuntimeError("failed after the products")
        return self.proj(y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(8, 16), Attention(), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.attn(self.embed(x)).mean(dim=1))


def _model():
    torch.manual_seed(0)
    return Net().eval()


def _cfg(folder, text):
    path = str(folder / "q.cfg")
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("mm")
    cfg, rec = _cfg(d, ON), str(d / "rec.txt")
    x = torch.randn(8, 12, 8, generator=torch.Generator().manual_seed(1))
    original = _model()
    c = amct.create_compressed_retrain_model(original, x, cfg, rec)
    assert not list(matmul_quants(original))  # the caller's model untouched
    c.train()
    opt = torch.optim.SGD(c.parameters(), lr=1e-2)
    loss = c(x).square().mean()
    loss.backward()
    grads = {k: q.clip_max.grad for k, q in c.attn.matmul_quant.quantizers().items()}
    opt.step()
    ref, ckpt = checkpoint_and_save(c, d, x, rec)
    return {"dir": d, "cfg": cfg, "rec": rec, "ckpt": ckpt, "x": x, "ref": ref, "model": c, "grads": grads}


def test_both_products_get_trained_quantizers(saved):
    (name, quant), = matmul_quants(saved["model"])
    assert name == "attn.matmul_quant"
    assert quant.sites == (1, 2)  # x @ mix (position 0) reads a parameter: a layer's kind of product
    qs = quant.quantizers()
    assert sorted(qs) == ["a0", "a1", "b0", "b1"]
    assert all(bool(q.initialized) for q in qs.values())
    assert all(g is not None and torch.isfinite(g).all() and g.abs() > 0 for g in saved["grads"].values())
    # the softmax output is in [0, 1]: its clip_min is pinned at 0, the others are not
    assert bool(qs["a1"].fixed_min) and float(qs["a1"].clip_min.detach()) == 0.0
    assert not any(bool(qs[k].fixed_min) for k in ("a0", "b0", "b1"))
    assert "attn.matmul_quant.q_a.1.clip_max" in saved["model"].state_dict()


def test_deploy_runs_both_in_int8(saved):
    d = saved["dir"]
    ops = collections.Counter(ort_optimized_ops(d / "m_deploy_model.onnx", d))
    # q @ k^T feeds the softmax (float): MatMulIntegerToFloat; softmax @ v feeds only the
    # projection's input quantizer (through Transpose/Reshape): QLinearMatMul
    assert ops["MatMulIntegerToFloat"] == 1 and ops["QLinearMatMul"] == 1, ops
    assert ops["MatMul"] + ops["FusedMatMul"] == 1, ops  # x @ mix only


def _ort(path, x):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x.numpy()})[0]


def test_fake_quant_and_deploy_reproduce_torch(saved):
    fake = _ort(str(saved["dir"] / "m_fake_quant_model.onnx"), saved["x"])
    deploy = _ort(str(saved["dir"] / "m_deploy_model.onnx"), saved["x"])
    assert_same_quantized_function(saved["ref"], fake, what="fake-quant vs torch")
    assert_same_quantized_function(fake, deploy, what="deploy vs fake-quant")


def test_restore_replays_them(saved):
    r = amct.restore_compressed_retrain_model(_model(), saved["x"], saved["cfg"], saved["rec"], saved["ckpt"],
                                              "state_dict")
    r.eval()
    with torch.no_grad():
        assert np.array_equal(r(saved["x"]).numpy(), saved["ref"])
    entries = [pr.selective_prune for pr in read_record(saved["rec"]).prune_record
               if selective_algorithm(pr) == ALGORITHM]
    assert [e.name for e in entries] == ["attn"]
    assert [n for n, _ in matmul_quants(r)] == ["attn.matmul_quant"]


def test_off_by_default_and_restore_refuses_a_mismatch(saved, tmp_path):
    x = saved["x"]
    plain = amct.create_compressed_retrain_model(_model(), x, _cfg(tmp_path, CFG), str(tmp_path / "r.txt"))
    assert not any(isinstance(m, MatMulQuant) for m in plain.modules())
    with pytest.raises(ValueError, match="quantize_activation_matmul"):
        amct.restore_compressed_retrain_model(_model(), x, _cfg(tmp_path, CFG), saved["rec"], saved["ckpt"],
                                              "state_dict")
    record = read_record(saved["rec"])
    entry = next(pr for pr in record.prune_record if selective_algorithm(pr) == ALGORITHM)
    del entry.selective_prune.attr[[a.name for a in entry.selective_prune.attr].index("sites")].ints[1]
    bad = str(tmp_path / "bad.txt")
    with open(saved["rec"], encoding="utf-8") as f:
        header = "".join(line for line in f if line.startswith("#"))
    write_record(bad, record, header)
    with pytest.raises(ValueError, match="products"):
        amct.restore_compressed_retrain_model(_model(), x, saved["cfg"], bad, saved["ckpt"], "state_dict")


def test_a_failed_forward_is_undone(tmp_path):
    """A forward that raises after the products leaves the mode (the post hook always runs) and,
    by the next forward, no trace in the quantizers: they initialise from the good batch."""
    x = torch.randn(4, 12, 8)

    def created(folder):
        folder.mkdir()
        m = amct.create_compressed_retrain_model(_model(), x, _cfg(folder, ON), str(folder / "r.txt"))
        return m.train()

    clean, m = created(tmp_path / "a"), created(tmp_path / "b")
    clean(x)
    m.attn.fail = True
    with pytest.raises(RuntimeError, match="after the products"):
        m(x * 1000)
    assert torch._C._len_torch_function_stack() == 0
    m.attn.fail = False
    m(x)
    for k, q in m.attn.matmul_quant.quantizers().items():
        want = clean.attn.matmul_quant.quantizers()[k]
        assert bool(q.initialized) and q.scale_offset() == want.scale_offset(), k
