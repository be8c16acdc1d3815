"""``save_*(..., placement="latency")``: blocks whose INT8 form is slower stay float in the deploy
file, the decision is recorded, and the file still computes what the fake-quant model does.

The decision tests give the planner its timing function (``timer``): times known in advance,
from a cost table per layer and form, so the decision is deterministic on any machine. The
files it chooses between are real (ORT runs them); only the clock is replaced."""

import collections
import json
import os
from collections import OrderedDict

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.export.placement import METADATA_KEY, latency_placement
from tests.numerics import assert_logits_agree

INT8 = ("retrain_data_quant_config { ulq_quantize { } }\n"
        "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n")
# (INT8 ms, float ms) per layer: "tiny" is the block whose INT8 form is slower
COST = {"big": (1.0, 4.0), "tiny": (3.0, 1.0), "head": (0.5, 1.0)}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        big=nn.Conv2d(3, 32, 3, padding=1), relu=nn.ReLU(), tiny=nn.Conv2d(32, 8, 1), relu2=nn.ReLU(),
        pool=nn.AdaptiveAvgPool2d(1), flat=nn.Flatten(), head=nn.Linear(8, 10))).eval()


def _saved(tmp_path, placement=None, report=None):
    cfg, rec = str(tmp_path / "q.cfg"), str(tmp_path / "rec.txt")
    with open(cfg, "w") as f:
        f.write(INT8)
    x = torch.randn(2, 3, 16, 16)
    c = amct.create_compressed_retrain_model(_net(), x, cfg, rec)
    c.train()
    with torch.no_grad():
        for _ in range(3):
            c(torch.randn(8, 3, 16, 16))
    c.eval()
    amct.save_compressed_retrain_model(c, rec, str(tmp_path / "m"), x, input_names=["x"], placement=placement,
                                       report=report)
    return str(tmp_path / "m_fake_quant_model.onnx"), str(tmp_path / "m_deploy_model.onnx"), x.numpy()


def _timer(cost):
    """A timer for ``latency_placement`` summing ``cost(node, float_weight)`` over the Conv/Gemm
    nodes of each model (a node reading a float weight initializer runs float)."""
    def timer(models: dict, feeds: dict) -> dict:
        out = {}
        for label, m in models.items():
            inits = {t.name for t in m.graph.initializer}
            out[label] = sum(cost(n, n.input[1] in inits) for n in m.graph.node if n.op_type in ("Conv", "Gemm"))
        return out
    return timer


def _table_cost(node, float_weight: bool) -> float:
    """ms of a node from COST."""
    layer = next(k for k in COST if f"/{k}/" in node.input[1])
    return COST[layer][1 if float_weight else 0]


_cost_timer = _timer(_table_cost)


def _agrees_with_fake(fake: str, deploy: str, what: str) -> None:
    xs = np.random.default_rng(1).standard_normal((64, 3, 16, 16)).astype(np.float32)
    f = ort.InferenceSession(fake, providers=["CPUExecutionProvider"])
    d = ort.InferenceSession(deploy.SerializeToString() if isinstance(deploy, onnx.ModelProto) else deploy,
                             providers=["CPUExecutionProvider"])
    ref = np.concatenate([f.run(None, {"x": xs[i:i + 2]})[0] for i in range(0, len(xs), 2)])  # (exported at batch 2)
    out = np.concatenate([d.run(None, {"x": xs[i:i + 2]})[0] for i in range(0, len(xs), 2)])
    assert_logits_agree(ref, out, max_rel_diff=0.03, min_decisive=0.5, min_cosine=0.999, what=what)


def _optimised_ops(model: onnx.ModelProto, tmp_path) -> collections.Counter:
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)


def test_the_block_slower_in_int8_stays_float(tmp_path):
    fake, deploy, x = _saved(tmp_path)
    before = onnx.load(deploy)
    placed, decision = latency_placement(before, {"x": x}, timer=_cost_timer, runtime="cost table")
    assert decision["chosen"] == "blocks" and decision["float_layers"] == ["tiny"], decision
    assert decision["blocks"]["tiny"] == {"int8_ms": 3.0, "float_ms": 1.0}
    assert decision["model_ms"] == {"int8": 4.5, "blocks": 2.5, "float": 6.0}
    assert json.loads({p.key: p.value for p in placed.metadata_props}[METADATA_KEY]) == decision
    ops = _optimised_ops(placed, tmp_path)
    assert ops["QLinearConv"] == 1 and ops["Conv"] == 1, dict(ops)  # big in integers, tiny float
    assert _optimised_ops(before, tmp_path)["QLinearConv"] == 2
    assert METADATA_KEY not in {p.key for p in before.metadata_props}  # the input model is left as it was
    _agrees_with_fake(fake, placed, "tiny float")


def test_int8_file_kept_unless_another_is_faster(tmp_path):
    fake, deploy, x = _saved(tmp_path)
    before = onnx.load(deploy)

    def ties(models, feeds):
        return {k: 1.0 for k in models}

    placed, decision = latency_placement(before, {"x": x}, timer=ties, runtime="ties")
    assert decision["chosen"] == "int8" and decision["float_layers"] == []
    del placed.metadata_props[-1]
    assert placed.SerializeToString() == before.SerializeToString()


def test_every_block_float_still_matches_fake_quant(tmp_path):
    """The largest departure the placement can make: every block float, every Q/DQ pair that no
    integer kernel uses dropped (the activation roundings fake-quant takes are skipped)."""
    fake, deploy, x = _saved(tmp_path)

    def float_wins(models, feeds):
        return {k: (0.5 if k == "float" else 2.0) for k in models}

    placed, decision = latency_placement(onnx.load(deploy), {"x": x}, timer=float_wins, runtime="float wins")
    assert decision["chosen"] == "float" and decision["float_layers"] == ["big", "head", "tiny"]
    ops = collections.Counter(n.op_type for n in placed.graph.node)
    assert "QuantizeLinear" not in ops and "DequantizeLinear" not in ops, dict(ops)
    _agrees_with_fake(fake, placed, "all float")


def test_save_with_placement_records_and_reports_it(tmp_path):
    lines = []
    fake, deploy, _ = _saved(tmp_path, placement="latency", report=lines.append)
    meta = {p.key: p.value for p in onnx.load(deploy).metadata_props}
    decision = json.loads(meta[METADATA_KEY])
    assert decision["placement"] == "latency" and set(decision["blocks"]) == {"big", "tiny", "head"}
    assert decision["chosen"] in decision["model_ms"]
    assert any(line.startswith("placement=latency") for line in lines), lines
    _agrees_with_fake(fake, deploy, f"placement chose {decision['chosen']}")


def test_default_save_records_no_placement(tmp_path):
    _, deploy, _ = _saved(tmp_path)
    assert METADATA_KEY not in {p.key for p in onnx.load(deploy).metadata_props}


@pytest.mark.parametrize("bad, error", [("fast", ValueError), (1, TypeError)])
def test_unknown_placement_is_refused_before_any_work(tmp_path, bad, error):
    with pytest.raises(error, match="placement"):
        _saved(tmp_path, placement=bad)
    assert not os.path.exists(tmp_path / "m_deploy_model.onnx")


class _Residual(nn.Module):
    """A residual block with a depthwise conv: the Q/DQ pairs around a float block are shared
    with an Add and with INT8 neighbours."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 16, 1)
        self.relu = nn.ReLU()
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        y = self.relu(self.stem(x))
        y = self.relu(y + self.pw(self.relu(self.dw(y))))
        return self.head(y.mean((2, 3)))


def test_a_float_depthwise_conv_inside_a_residual_block(tmp_path):
    cfg, rec = str(tmp_path / "q.cfg"), str(tmp_path / "rec.txt")
    with open(cfg, "w") as f:
        f.write(INT8)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    c = amct.create_compressed_retrain_model(_Residual().eval(), x, cfg, rec)
    c.train()
    with torch.no_grad():
        for _ in range(3):
            c(torch.randn(8, 3, 16, 16))
    c.eval()
    amct.save_compressed_retrain_model(c, rec, str(tmp_path / "m"), x, input_names=["x"])

    def depthwise_slow(node, float_weight):  # a grouped conv costs 3 in INT8 and 1 in float, the rest 1 and 2
        grouped = any(a.name == "group" and a.i > 1 for a in node.attribute)
        return (1.0 if grouped else 2.0) if float_weight else (3.0 if grouped else 1.0)

    before = onnx.load(str(tmp_path / "m_deploy_model.onnx"))
    placed, decision = latency_placement(before, {"x": x.numpy()}, timer=_timer(depthwise_slow), runtime="cost table")
    assert decision["chosen"] == "blocks" and decision["float_layers"] == ["dw"], decision
    ops, int8 = _optimised_ops(placed, tmp_path), _optimised_ops(before, tmp_path)
    assert ops["QLinearConv"] == int8["QLinearConv"] - 1 and ops["Conv"] + ops["FusedConv"] == \
        int8["Conv"] + int8["FusedConv"] + 1, (dict(ops), dict(int8))
    _agrees_with_fake(str(tmp_path / "m_fake_quant_model.onnx"), placed, "float depthwise conv")
