"""nn.MultiheadAttention in the compressed working copy becomes openamct's
UnfusedMultiheadAttention (compressed/attention.py): the same function, its in- and
out-projections ordinary Linear layers, its attention products explicit MatMuls."""

from __future__ import annotations

import collections
import copy
import itertools
import logging

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.compressed.attention import UnfusedMultiheadAttention, substitute_attention
from openamct.compressed.layer import CompressedLayer
from tests.runtimes import ort_optimized_ops
from tests.small import write_cfg

E, H = 16, 4


def _pair(batch_first: bool, bias: bool = True, dropout: float = 0.0):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, dropout=dropout, bias=bias, batch_first=batch_first)
    with torch.no_grad():
        for p in mha.parameters():
            p.normal_()
    return mha, UnfusedMultiheadAttention.from_torch(copy.deepcopy(mha))


def _cases(batch_first: bool):
    n, tgt, src = 2, 5, 7
    g = torch.Generator().manual_seed(1)

    def seq(length):
        return torch.randn((n, length, E) if batch_first else (length, n, E), generator=g)

    x, kv = seq(tgt), seq(src)
    causal = nn.Transformer.generate_square_subsequent_mask(tgt)
    pad_t, pad_s = torch.rand(n, tgt, generator=g) > 0.6, torch.rand(n, src, generator=g) > 0.6
    hide = torch.rand(tgt, src, generator=g) > 0.8
    pad_t[:, 0] = pad_s[:, 0] = hide[:, 0] = False  # no fully masked row (NaN on both sides)
    one = (lambda t: t[0]) if batch_first else (lambda t: t[:, 0])
    return [
        ((x, x, x), {}),
        ((x, x, x), {"need_weights": False}),
        ((x, x, x), {"attn_mask": causal, "is_causal": True, "need_weights": False}),
        ((x, x, x), {"attn_mask": torch.randn(n * H, tgt, tgt, generator=g), "key_padding_mask": pad_t.float() * -1e4,
                     "average_attn_weights": False}),
        ((x, kv, kv), {"attn_mask": hide, "key_padding_mask": pad_s}),
        ((x, kv, kv.clone()), {"need_weights": False}),
        ((one(x), one(x), one(x)), {}),  # unbatched
    ]


@pytest.mark.parametrize("batch_first", [True, False])
def test_it_computes_what_torch_computes_in_train_and_eval(batch_first):
    for bias in (True, False):
        mha, packed = _pair(batch_first, bias)
        split = copy.deepcopy(packed)
        split.split_in_proj()  # the cross-attention layout
        assert torch.equal(split.in_proj_weight, packed.in_proj_weight)
        for train in (True, False):
            for grad in (True, False):  # eval without grad is torch's fused fast path
                for ours, (args, kwargs) in itertools.product((packed, split), _cases(batch_first)):
                    mha.train(train), ours.train(train)
                    with torch.set_grad_enabled(grad):
                        want, got = mha(*args, **kwargs), ours(*args, **kwargs)
                    assert got[0].shape == want[0].shape
                    assert torch.allclose(got[0], want[0], atol=1e-4), (kwargs.keys(), (got[0] - want[0]).abs().max())
                    assert (got[1] is None) == (want[1] is None)
                    if want[1] is not None:
                        assert torch.allclose(got[1], want[1], atol=1e-5)
    # dropout on the attention weights: the same in eval, random (and scaled) in training
    mha, ours = _pair(batch_first, dropout=0.5)
    x = _cases(batch_first)[0][0][0]
    assert torch.allclose(ours.eval()(x, x, x)[0], mha.eval()(x, x, x)[0], atol=1e-4)
    w = ours.train()(x, x, x)[1]
    assert not torch.allclose(w, ours.eval()(x, x, x)[1])


def test_unsupported_ones_stay_float_with_one_warning_per_reason(caplog):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.MultiheadAttention(E, H, add_bias_kv=True)
            self.b = nn.MultiheadAttention(E, H, add_bias_kv=True)
            self.c = nn.MultiheadAttention(E, H, kdim=8, vdim=8)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, batch_first=True), 2,
                                             enable_nested_tensor=True)
            self.shared = self.enc.layers[0].self_attn  # one module under two names: one replacement

    net = Net()
    work = copy.deepcopy(net)
    with caplog.at_level(logging.WARNING):
        done = substitute_attention(work)
    assert sorted(done) == ["enc.layers.0.self_attn", "enc.layers.1.self_attn", "shared"]
    assert work.shared is work.enc.layers[0].self_attn
    assert [type(m) for m in (work.a, work.b, work.c)] == [nn.MultiheadAttention] * 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and any("add_bias_kv=True" in w and ": 2:" in w for w in warnings), warnings
    assert isinstance(net.enc.layers[0].self_attn, nn.MultiheadAttention)  # the original untouched
    # torch's encoder fast paths (nested tensors, the fused layer) are off: eval runs our module
    x, pad = torch.randn(2, 5, E), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    net.eval(), work.eval()
    with torch.no_grad():
        got = work.enc(x, src_key_padding_mask=pad)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            want = net.enc(x, src_key_padding_mask=pad)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    assert torch.allclose(got, want, atol=1e-5)


class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.self_attention = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))

    def forward(self, x):
        y = self.ln(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)  # as torchvision's ViT calls it
        x = x + y
        return x + self.mlp(x)


class TinyViT(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, d, 4, 4)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.layers = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        return self.head(self.layers(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1))[:, 0])


def test_vit_like_model_quantizes_its_attention_through_the_lifecycle(tmp_path):
    cfg = tmp_path / "q.cfg"
    cfg.write_text("retrain_data_quant_config: { ulq_quantize: { } }\n"
                   "retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }\n"
                   "quantize_activation_matmul: true\n")
    rec, ckpt = str(tmp_path / "r.txt"), str(tmp_path / "c.pth")
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    original = TinyViT().eval()
    m = amct.create_compressed_retrain_model(original, x, str(cfg), rec)
    assert isinstance(original.layers[0].self_attention, nn.MultiheadAttention)  # the caller's model untouched
    for i in (0, 1):
        assert isinstance(m.get_submodule(f"layers.{i}.self_attention.in_proj"), CompressedLayer)
        assert isinstance(m.get_submodule(f"layers.{i}.self_attention.out_proj"), CompressedLayer)
    with open(rec) as f:
        assert "# openamct-layer: layers.0.self_attention.in_proj Linear 48x16" in f.read()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    m.train()
    m(x).square().mean().backward()
    opt.step()
    m.eval()
    with torch.no_grad():
        want = m(x)
    torch.save(m.state_dict(), ckpt)
    r = amct.restore_compressed_retrain_model(TinyViT().eval(), x, str(cfg), rec, ckpt).eval()
    with torch.no_grad():
        assert torch.equal(r(x), want)
    assert r.state_dict().keys() == m.state_dict().keys()
    amct.save_compressed_retrain_model(r, rec, str(tmp_path / "vit"), x)
    deploy, fake = str(tmp_path / "vit_deploy_model.onnx"), str(tmp_path / "vit_fake_quant_model.onnx")
    ops = collections.Counter(ort_optimized_ops(deploy, tmp_path))
    # 2 blocks x (in_proj, out_proj, 2 MLP Linears) + head: all integer; both products of each
    # block integer; no float MatMul or Gemm left
    assert ops["QGemm"] + ops["MatMulInteger"] + ops["DynamicQuantizeMatMul"] >= 9, ops
    assert ops["QLinearMatMul"] + ops["MatMulIntegerToFloat"] == 4, ops
    assert not ops["MatMul"] and not ops["Gemm"] and not ops["FusedMatMul"], ops
    sessions = [ort.InferenceSession(p, providers=["CPUExecutionProvider"]) for p in (fake, deploy)]
    outs = [s.run(None, {s.get_inputs()[0].name: x.numpy()})[0] for s in sessions]
    assert np.allclose(outs[0], want.numpy(), atol=1e-3)
    cos = (outs[0] * outs[1]).sum() / np.linalg.norm(outs[0]) / np.linalg.norm(outs[1])
    assert cos > 0.999, cos


class Decoder(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.inp, self.mem = nn.Linear(8, d), nn.Linear(8, d)
        self.dec = nn.TransformerDecoderLayer(d, 2, 32, dropout=0.0)  # sequence first
        self.head = nn.Linear(d, 3)

    def forward(self, x, memory):
        t, m = self.inp(x).transpose(0, 1), self.mem(memory).transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(t.shape[0])
        return self.head(self.dec(t, m, tgt_mask=causal, tgt_is_causal=True)).mean(0)


def test_cross_attention_gets_a_layer_per_projection(tmp_path, caplog):
    torch.manual_seed(0)
    x = (torch.randn(2, 5, 8), torch.randn(2, 7, 8))
    cfg, rec = write_cfg(tmp_path), str(tmp_path / "r.txt")
    with caplog.at_level(logging.WARNING):
        m = amct.create_compressed_retrain_model(Decoder().eval(), x, cfg, rec)
    assert not [r for r in caplog.records if "uncompressed" in r.getMessage()]
    for name in ("self_attn.in_proj", "self_attn.out_proj", "multihead_attn.q_proj", "multihead_attn.k_proj",
                 "multihead_attn.v_proj", "multihead_attn.out_proj"):
        assert isinstance(m.get_submodule(f"dec.{name}"), CompressedLayer), name
    m.train()
    m(*x)
    m.eval()
    torch.save(m.state_dict(), tmp_path / "c.pth")
    r = amct.restore_compressed_retrain_model(Decoder().eval(), x, cfg, rec, str(tmp_path / "c.pth")).eval()
    with torch.no_grad():
        assert torch.equal(r(*x), m(*x))
