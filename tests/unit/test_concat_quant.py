"""A concat that quantized layers read gets their input quantizer on every input (a hook on each
module returning one), and a layer reading a max pool shares the quantizer of the layers reading
the pool's input: the deploy model's Concat and MaxPool then read DequantizeLinears of one
qparams (ORT: QLinearConcat, uint8 MaxPool) and fake-quant computes what deploy does. A
Hardswish after a quantized layer is wrapped like a SiLU (its input quantized). Inception-v3's
other sites (``Tail``): a stem max pool that convs and an average pool read, a reduction
block's concat with a max-pooled input that convs and an average pool read, and a last block's
concat only the global average pool reads (its own quantizer). ShuffleNetV2's units
(``Shuffle``): a split half passed on to the next concat, the shuffle's view/transpose, all on
uint8 in deploy."""

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import openamct as amct
from openamct.quant.activation import QuantizedActivation
from openamct.quant.residual import output_hooks
from openamct.record.file_io import read_record
from openamct.techniques.activation_quant import ALGORITHM
from openamct.techniques.base import selective_algorithm
from tests.models import spread_bn_scales
from tests.numerics import assert_same_quantized_function
from tests.runtimes import ort_optimized_ops, ort_run
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


class Conv(nn.Module):  # torchvision's BasicConv2d
    def __init__(self, cin: int, cout: int, k: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return torch.relu_(self.bn(self.conv(x)))


class BlockA(nn.Module):  # Inception-A: a branch convolving the average pool of the block's input
    def __init__(self, cin: int, c: int) -> None:
        super().__init__()
        self.b1, self.b2, self.bp = Conv(cin, c, 1), Conv(cin, c, 3), Conv(cin, c, 1)

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.bp(F.avg_pool2d(x, 3, 1, 1))], 1)


class Reduction(nn.Module):  # Inception's Mixed_6a: a strided conv beside a max pool of the input
    def __init__(self, cin: int, c: int) -> None:
        super().__init__()
        self.b = Conv(cin, c, 3, 2)

    def forward(self, x):
        return torch.cat([self.b(x), F.max_pool2d(x, 3, 2, 1)], 1)


class Tail(nn.Module):
    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.stem, self.pool = Conv(1, c, 3), nn.MaxPool2d(2)
        self.a, self.r, self.a2 = BlockA(c, c), Reduction(3 * c, c), BlockA(4 * c, c)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(3 * c, 4)

    def forward(self, x):
        x = self.a2(self.r(self.a(self.pool(self.stem(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _shuffle(x):  # torchvision's channel_shuffle, 2 groups
    b, c, h, w = x.shape
    return x.view(b, 2, c // 2, h, w).transpose(1, 2).contiguous().view(b, c, h, w)


class Down(nn.Module):  # ShuffleNetV2's stride-2 unit
    def __init__(self, cin: int, c: int) -> None:
        super().__init__()
        self.b1, self.b2 = Conv(cin, c // 2, 3, 2), Conv(cin, c // 2, 1, 2)

    def forward(self, x):
        return _shuffle(torch.cat((self.b1(x), self.b2(x)), 1))


class Unit(nn.Module):  # ShuffleNetV2's stride-1 unit: half the channels pass through
    def __init__(self, c: int) -> None:
        super().__init__()
        self.branch = Conv(c // 2, c // 2, 3)

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=1)
        return _shuffle(torch.cat((x1, self.branch(x2)), 1))


class Shuffle(nn.Module):
    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.stem, self.down, self.u1, self.u2 = Conv(1, c, 3), Down(c, 2 * c), Unit(2 * c), Unit(2 * c)
        self.head = nn.Conv2d(2 * c, 3, 1, bias=False)

    def forward(self, x):
        return self.head(self.u2(self.u1(self.down(self.stem(x)))))


def _tail():
    torch.manual_seed(0)
    return spread_bn_scales(Tail())


def _shuffle_net():
    torch.manual_seed(0)
    return spread_bn_scales(Shuffle())


def _model():
    torch.manual_seed(0)
    return spread_bn_scales(InceptionLike())


@pytest.fixture(scope="module")
def x():
    return torch.randn(8, 1, 10, 10, generator=torch.Generator().manual_seed(1)) ** 3


def _saved(d, x, make):
    cfg, rec = str(d / "q.cfg"), str(d / "rec.txt")
    with open(cfg, "w") as f:
        f.write(CFG)
    original = make()
    c = amct.create_compressed_retrain_model(original, x, cfg, rec)
    assert not output_hooks(original)  # the caller's model untouched
    c.train()
    with torch.no_grad():
        c(x)
    ref, ckpt = checkpoint_and_save(c, d, x, rec)
    return {"c": c, "dir": d, "cfg": cfg, "rec": rec, "ckpt": ckpt, "ref": ref}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, x):
    return _saved(tmp_path_factory.mktemp("cq"), x, _model)


@pytest.fixture(scope="module")
def tail(tmp_path_factory):
    x = torch.randn(8, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    return {**_saved(tmp_path_factory.mktemp("tail"), x, _tail), "x": x}


@pytest.fixture(scope="module")
def shuffle(tmp_path_factory):
    x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    return {**_saved(tmp_path_factory.mktemp("shuffle"), x, _shuffle_net), "x": x}


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
    fake = ort_run(str(d / "m_fake_quant_model.onnx"), x)
    assert_same_quantized_function(saved["ref"], fake, what="fake-quant vs torch")
    deploy = ort_run(str(d / "m_deploy_model.onnx"), x)
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


def test_pool_read_sites_take_a_trained_quantizer_recorded_and_replayed(tail):
    c, x = tail["c"], tail["x"]
    hooks = dict(output_hooks(c))
    # the stem pool: its readers' quantizer; r: the quantizer of a2's convs on its inputs and
    # its output; a2: its own, on its inputs and output
    assert sorted(hooks) == ["a.b1", "a.b2", "a.bp", "a2", "a2.b1", "a2.b2", "a2.bp", "pool", "r", "r.b"]
    assert hooks["pool"].quantizer is c.a.b1.conv.act_quant is c.a.b2.conv.act_quant
    assert hooks["r"].quantizer is hooks["r.b"].quantizer is c.a2.b1.conv.act_quant
    own = c.a2.concat_quant
    assert all(hooks[m].quantizer is own for m in ("a2", "a2.b1", "a2.b2", "a2.bp")) and bool(own.initialized)
    entries = {pr.selective_prune.name: {a.name: a for a in pr.selective_prune.attr}
               for pr in read_record(tail["rec"]).prune_record if selective_algorithm(pr) == ALGORITHM}
    assert entries["pool"]["op"].s == b"residual"
    (r_cat,) = [n for n in entries if n.startswith("r:")]
    (a2_cat,) = [n for n in entries if n.startswith("a2:")]
    assert entries[r_cat]["output"].s == b"r" and "scale_d" not in entries[r_cat]
    a2 = entries[a2_cat]
    assert a2["output"].s == b"a2" and not a2["layers"].strings
    assert (a2["scale_d"].floats[0], a2["offset_d"].ints[0]) == pytest.approx(own.scale_offset())
    r = amct.restore_compressed_retrain_model(_tail(), x, tail["cfg"], tail["rec"], tail["ckpt"], "state_dict")
    r.eval()
    assert sorted(n for n, _ in output_hooks(r)) == sorted(hooks)
    assert r.a2.concat_quant.scale_offset() == own.scale_offset()
    with torch.no_grad():
        assert np.array_equal(r(x).numpy(), tail["ref"])


def test_pool_read_sites_run_int8_in_deploy_and_match_fake_quant(tail):
    d, x = tail["dir"], tail["x"]
    fake = ort_run(str(d / "m_fake_quant_model.onnx"), x)
    assert_same_quantized_function(tail["ref"], fake, what="fake-quant vs torch")
    assert_same_quantized_function(fake, ort_run(str(d / "m_deploy_model.onnx"), x), what="deploy vs fake-quant")
    ops = ort_optimized_ops(str(d / "m_deploy_model.onnx"), d)
    assert ops.count("QLinearConcat") == 3 and ops.count("QLinearAveragePool") == 2, ops
    assert ops.count("QLinearGlobalAveragePool") == 1, ops
    assert not {"Concat", "AveragePool", "GlobalAveragePool", "MaxPool"} & set(ops), ops


def test_shufflenet_split_and_shuffle_run_on_uint8_and_restore(shuffle):
    c, x, d = shuffle["c"], shuffle["x"], shuffle["dir"]
    hooks = dict(output_hooks(c))
    # each concat on the grid of the layer behind the next split (the last: the head's), the
    # modules returning a shuffle that a split reads hooked too
    assert sorted(hooks) == ["down", "down.b1", "down.b2", "u1", "u1.branch", "u2.branch"]
    assert all(hooks[m].quantizer is c.u1.branch.conv.act_quant for m in ("down", "down.b1", "down.b2"))
    assert hooks["u1"].quantizer is hooks["u1.branch"].quantizer is c.u2.branch.conv.act_quant
    assert hooks["u2.branch"].quantizer is c.head.act_quant
    fake = ort_run(str(d / "m_fake_quant_model.onnx"), x)
    assert_same_quantized_function(shuffle["ref"], fake, what="fake-quant vs torch")
    assert_same_quantized_function(fake, ort_run(str(d / "m_deploy_model.onnx"), x), what="deploy vs fake-quant")
    # the shuffles' 5-D view/transpose/view move H and W as one axis (deploy._flat_shuffles)
    perms = [list(a.ints) for n in onnx.load(str(d / "m_deploy_model.onnx")).graph.node
             if n.op_type == "Transpose" for a in n.attribute if a.name == "perm"]
    assert perms == [[0, 2, 1, 3]] * 3, perms
    ops = ort_optimized_ops(str(d / "m_deploy_model.onnx"), d)
    g = onnx.load(str(d / "opt.onnx")).graph  # (the graph ort_optimized_ops wrote)
    made_by = {o: n.op_type for n in g.node for o in n.output}
    assert ops.count("QLinearConcat") == 3 and "Concat" not in ops, ops
    # the split, the shuffles' reshapes and transposes read uint8 tensors
    moves = [n for n in g.node if n.op_type in ("Split", "Reshape", "Transpose") and n.input[0] in made_by]
    assert moves and not [n.name for n in moves if made_by[n.input[0]] == "DequantizeLinear"], ops
    r = amct.restore_compressed_retrain_model(_shuffle_net(), x, shuffle["cfg"], shuffle["rec"], shuffle["ckpt"],
                                              "state_dict")
    r.eval()
    assert sorted(n for n, _ in output_hooks(r)) == sorted(hooks)
    with torch.no_grad():
        assert np.array_equal(r(x).numpy(), shuffle["ref"])
