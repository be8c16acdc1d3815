"""A concat that quantized layers read gets their input quantizer on every input (a hook on each
module returning one), and a layer reading a max pool shares the quantizer of the layers reading
the pool's input: the deploy model's Concat and MaxPool then read DequantizeLinears of one
qparams (ORT: QLinearConcat, uint8 MaxPool) and fake-quant computes what deploy does. A
Hardswish after a quantized layer is wrapped like a SiLU (its input quantized)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.quant.activation import QuantizedActivation
from openamct.quant.residual import output_hooks
from openamct.record.file_io import read_record
from openamct.techniques.activation_quant import ALGORITHM
from openamct.techniques.base import selective_algorithm
from tests.numerics import assert_same_quantized_function
from tests.runtimes import ort_optimized_ops
from tests.training import checkpoint_and_save

CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
"""


class Branch(nn.Module):
    def __init__(self, c: int, k: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, k, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu_(self.bn(self.conv(x)))  # in place, as torchvision's BasicConv2d


class InceptionLike(nn.Module):
    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.ReLU()
        self.hs = nn.Hardswish()
        self.b1, self.b2, self.b3 = Branch(c, 1), Branch(c, 3), Branch(c, 1)
        self.pool = nn.MaxPool2d(3, 1, 1)
        self.head = nn.Conv2d(3 * c, 4, 1, bias=False)

    def forward(self, x):
        t = self.act(self.bn(self.stem(x)))
        y = torch.cat([self.b1(t), self.b2(t), self.b3(self.pool(t))], 1)
        return self.hs(self.head(y))


def _model():
    torch.manual_seed(0)
    m = InceptionLike()
    with torch.no_grad():
        for b in m.modules():
            if isinstance(b, nn.BatchNorm2d):
                b.weight.uniform_(0.5, 2.0)  # no biases: the deploy file's int32 biases are exact
    return m.eval()


def _ort(path, x):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the file's own arithmetic
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]


@pytest.fixture(scope="module")
def x():
    return torch.randn(8, 1, 10, 10, generator=torch.Generator().manual_seed(1)) ** 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory, x):
    d = tmp_path_factory.mktemp("cq")
    cfg, rec = str(d / "q.cfg"), str(d / "rec.txt")
    with open(cfg, "w") as f:
        f.write(CFG)
    original = _model()
    c = amct.create_compressed_retrain_model(original, x, cfg, rec)
    assert not output_hooks(original)  # the caller's model untouched
    c.train()
    with torch.no_grad():
        c(x)
    ref, ckpt = checkpoint_and_save(c, d, x, rec)
    return {"c": c, "dir": d, "cfg": cfg, "rec": rec, "ckpt": ckpt, "ref": ref}


def test_concat_inputs_take_the_readers_quantizer(saved):
    c = saved["c"]
    hooks = dict(output_hooks(c))
    assert sorted(hooks) == ["b1", "b2", "b3"]
    assert all(h.quantizer is c.head.act_quant for h in hooks.values())
    assert c.b3.conv.act_quant is c.b1.conv.act_quant is c.b2.conv.act_quant  # through the max pool
    assert isinstance(c.hs, QuantizedActivation) and c.hs.kind == "hardswish" and c.hs.q_inner is not None and c.hs.q_out is None
    entries = {pr.selective_prune.name: pr.selective_prune for pr in read_record(saved["rec"]).prune_record
               if selective_algorithm(pr) == ALGORITHM}
    assert set(entries) == {"cat_0", "hs"}
    attrs = {a.name: [s.decode() for s in a.strings] for a in entries["cat_0"].attr}
    assert attrs["inputs"] == ["b1", "b2", "b3"] and attrs["layers"] == ["head"]


def test_deploy_runs_concat_and_pool_on_one_grid_and_matches_fake_quant(saved, x):
    d = saved["dir"]
    fake = _ort(str(d / "m_fake_quant_model.onnx"), x)
    assert_same_quantized_function(saved["ref"], fake, what="fake-quant vs torch")
    deploy = _ort(str(d / "m_deploy_model.onnx"), x)
    assert_same_quantized_function(fake, deploy, what="deploy vs fake-quant")
    g = onnx.load(str(d / "m_deploy_model.onnx")).graph
    made_by = {o: n for n in g.node for o in n.output}
    init = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}

    def qparams(n):
        return float(init[n.input[1]]), int(init[n.input[2]])

    for op in ("Concat", "MaxPool"):
        (n,) = [n for n in g.node if n.op_type == op]
        dqs = [made_by[i] for i in n.input]
        assert all(p.op_type == "DequantizeLinear" for p in dqs), op
        qs = [u for u in g.node if n.output[0] in u.input]
        assert qs and all(u.op_type == "QuantizeLinear" for u in qs), op
        assert len({qparams(p) for p in dqs + qs}) == 1, op  # one grid: ORT copies / pools bytes
    ops = ort_optimized_ops(str(d / "m_deploy_model.onnx"), d)
    assert ops.count("QLinearConcat") == 1 and "Concat" not in ops and "MaxPool" not in ops, ops




def test_restore_replays_the_concat_hooks(saved, x):
    r = amct.restore_compressed_retrain_model(_model(), x, saved["cfg"], saved["rec"], saved["ckpt"], "state_dict")
    r.eval()
    assert sorted(n for n, _ in output_hooks(r)) == ["b1", "b2", "b3"]
    with torch.no_grad():
        assert np.array_equal(r(x).numpy(), saved["ref"])
