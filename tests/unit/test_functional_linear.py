"""A Linear its owner never calls but computes as ``F.linear(x, self.lin.weight, self.lin.bias)``
(torchvision Swin's ``shifted_window_attention``) is quantized (and 2:4-sparsified) like any
other layer: the call runs the compressed layer in training, after restore and in both ONNX
files, whose deploy model then has no float Gemm/MatMul left for it."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import openamct as amct
from openamct.compressed.functional import routed_owners
from openamct.compressed.layer import CompressedLayer
from openamct.record.file_io import read_record
from tests.numerics import assert_same_quantized_function
from tests.training import checkpoint_and_save

QUANT = ("retrain_data_quant_config { ulq_quantize { } }\n"
         "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n")
NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { } } }\n"


def _mix(x, qkv_w, proj_w, qkv_b, proj_b):
    """A free function, as torchvision's: the owner's forward is the nearest module frame."""
    q, k, v = F.linear(x, qkv_w, qkv_b).chunk(3, dim=-1)
    return F.linear(torch.relu(q) * torch.sigmoid(k) + v, proj_w, bias=proj_b)


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        return x + _mix(x, self.qkv.weight, self.proj.weight, self.qkv.bias, self.proj.bias)


class CalledBlock(Block):
    """The same computation calling its Linears: what the functional one must match exactly."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.proj(torch.relu(q) * torch.sigmoid(k) + v)


class Net(nn.Module):
    def __init__(self, block=Block) -> None:
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(8, 16), block(), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(self.embed(x)).mean(dim=1))


def _model(block=Block):
    torch.manual_seed(0)
    return Net(block).eval()


def _trained(model, x, folder, cfg):
    rec = str(folder / "rec.txt")
    c = amct.create_compressed_retrain_model(model, x, cfg, rec)
    c.train()
    opt = torch.optim.SGD(c.parameters(), lr=1e-2)
    c(x).square().mean().backward()
    grads = {n: (c.get_submodule(n).weight.grad, c.get_submodule(n).act_quant.clip_max.grad)
             for n in ("block.qkv", "block.proj")}
    opt.step()
    c(x)  # a second step: the weight moved, clips stay initialised
    ref, ckpt = checkpoint_and_save(c, folder, x, rec)
    return c, rec, ref, ckpt, grads


@pytest.fixture(scope="module", params=["quant", "quant+2:4"])
def saved(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("fl")
    cfg, rec = str(d / "q.cfg"), str(d / "rec.txt")
    with open(cfg, "w") as f:
        f.write(QUANT + (NM if "2:4" in request.param else ""))
    x = torch.randn(8, 6, 8, generator=torch.Generator().manual_seed(1))
    original = _model()
    c, rec, ref, ckpt, grads = _trained(original, x, d, cfg)
    assert not routed_owners(original) and isinstance(original.block.qkv, nn.Linear)  # caller's model untouched
    twin = d / "twin"
    twin.mkdir()
    _, _, twin_ref, _, _ = _trained(_model(CalledBlock), x, twin, cfg)
    return {"dir": d, "cfg": cfg, "rec": rec, "ckpt": ckpt, "x": x, "ref": ref, "model": c, "grads": grads,
            "twin": twin, "twin_ref": twin_ref, "nm": "2:4" in request.param}


def test_the_functional_linears_are_compressed_and_trained(saved):
    c = saved["model"]
    assert routed_owners(c) == {"block": ((0, "qkv"), (1, "proj"))}
    for name in ("block.qkv", "block.proj"):
        layer = c.get_submodule(name)
        assert isinstance(layer, CompressedLayer) and bool(layer.act_quant.initialized), name
        w_grad, clip_grad = saved["grads"][name]
        assert w_grad is not None and w_grad.abs().sum() > 0, name
        assert clip_grad is not None and torch.isfinite(clip_grad).all() and clip_grad.abs() > 0, name
        if saved["nm"]:
            w, _ = layer.effective_weight_bias()
            assert (w.reshape(w.shape[0], -1, 4) != 0).sum(-1).max() <= 2, name
    keys = [e.key for e in read_record(saved["rec"]).record]
    assert "block.qkv" in keys and "block.proj" in keys
    # the routed call is the quantized layer: a float F.linear on the raw weights differs
    x = c.embed(saved["x"])
    with torch.no_grad():
        float_out = x + _mix(x, c.block.qkv.weight, c.block.proj.weight, c.block.qkv.bias, c.block.proj.bias)
        assert not torch.equal(c.block(x), float_out)


def test_restore_is_exact(saved):
    r = amct.restore_compressed_retrain_model(_model(), saved["x"], saved["cfg"], saved["rec"], saved["ckpt"],
                                              "state_dict")
    r.eval()
    assert routed_owners(r) == {"block": ((0, "qkv"), (1, "proj"))}
    with torch.no_grad():
        assert np.array_equal(r(saved["x"]).numpy(), saved["ref"])


def test_it_computes_what_called_linears_compute(saved):
    """The functional model trains, records and exports what the same model calling its
    Linears does: the same outputs in torch and in both ONNX files."""
    assert np.array_equal(saved["ref"], saved["twin_ref"])
    for kind in ("fake_quant", "deploy"):
        got = _ort(str(saved["dir"] / f"m_{kind}_model.onnx"), saved["x"])
        want = _ort(str(saved["twin"] / f"m_{kind}_model.onnx"), saved["x"])
        assert np.array_equal(got, want), kind


def _ort(path, x, optimized=None):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if optimized:
        so.optimized_model_filepath = optimized
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x.numpy()})[0]


def test_onnx_files_run_it_quantized(saved):
    d, x = saved["dir"], saved["x"]
    fake = _ort(str(d / "m_fake_quant_model.onnx"), x)
    deploy = _ort(str(d / "m_deploy_model.onnx"), x, str(d / "opt.onnx"))
    assert_same_quantized_function(saved["ref"], fake, what="fake-quant vs torch")
    # the head's int8 output (QGemm) moves every element by up to its output grid step
    assert np.abs(deploy - fake).max() <= 0.02 * np.ptp(fake), np.abs(deploy - fake).max()
    ops = collections.Counter(n.op_type for n in onnx.load(str(d / "opt.onnx")).graph.node)
    assert ops["Gemm"] + ops["MatMul"] + ops["FusedMatMul"] == 0, ops  # every Linear is an int8 kernel
    int8 = sum(ops[k] for k in ("QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "MatMulInteger",
                                "DynamicQuantizeMatMul"))
    assert int8 == 4, ops  # embed, qkv, proj, head


class OtherBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.b = nn.Parameter(torch.zeros(8))

    def forward(self, x):
        return F.linear(x, self.lin.weight, self.b)


class TwoCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return F.linear(F.linear(x, self.lin.weight, self.lin.bias), self.lin.weight, self.lin.bias)


class NoBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return F.linear(x, self.lin.weight)


@pytest.mark.parametrize("cls,why", [(OtherBias, "does not take exactly its weight and bias"),
                                     (TwoCalls, "read by 2 torch call(s) (linear)"), (NoBias, None)])
def test_discovery_takes_only_one_exact_call(cls, why):
    from openamct.graph.capture import capture_graph
    from openamct.graph.layers import find_layers
    from openamct.techniques.filter_prune import FilterPruning

    model = cls().eval()
    graph = capture_graph(model, torch.randn(2, 8))
    info = find_layers(model, graph)["lin"]
    if why is None:
        assert info.excluded is None and info.functional == ("", 0)
        assert graph.call_of("lin").op == "linear"
        assert "F.linear" in FilterPruning().eligible(info)
    else:
        assert info.functional is None and why in info.excluded
