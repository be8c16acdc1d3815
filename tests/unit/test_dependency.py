"""Channel-dependency analysis on real models: which layers are coupled, where channels
land in their consumers, and what stops pruning (and why)."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from openamct.config.parse import load_config
from openamct.config.source import build_plan
from openamct.config.specs import LayerPlan, Plan
from openamct.graph.capture import capture_graph
from openamct.graph.layers import find_layers
from openamct.sparsity.dependency import analyse
from openamct.sparsity.index_mapping import (
    ChannelMap,
    Segment,
    align,
    follow,
    index_axis,
    reshape_axis,
)
from openamct.techniques import TECHNIQUES
from openamct.techniques.filter_prune import FilterSpec
from tests.conftest import compat_config
from tests.models import (
    ConcatNet,
    DepthwiseSeparableNet,
    EltwiseGroupNet,
    MobileNetV2Tiny,
    Net001,
    PoolFlattenLinearNet,
    ResBlockNet,
    ReusedModuleNet,
    TinyTransformerBlock,
    UNetTiny,
    UntraceableNet,
    example_input,
)

# -- models -------------------------------------------------------------------------------------

class GateNet(nn.Module):
    """Squeeze-excitation gate (per-channel: couples) and a per-sample scale (broadcast: doesn't)."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc1, self.fc2 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 8, 1), nn.Conv2d(8, 32, 1)
        self.scale, self.out = nn.Conv2d(3, 1, 1), nn.Conv2d(32, 4, 1)

    def forward(self, x):
        y = F.relu(self.conv(x))
        gate = torch.sigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(y, 1)))))
        s = self.scale(x).mean((2, 3), keepdim=True)  # (N, 1, 1, 1)
        return self.out(y * gate * s).mean((2, 3))


class DenseCatNet(nn.Module):
    """Concat with the graph input (untracked positions) and a depthwise conv with multiplier 2."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(11, 8, 3, padding=1)
        self.dw, self.bn, self.out = nn.Conv2d(19, 38, 3, padding=1, groups=19), nn.BatchNorm2d(38), nn.Conv2d(38, 4, 1)

    def forward(self, x):
        y = torch.cat([x, F.relu(self.c1(x))], 1)
        y = torch.cat([y, F.relu(self.c2(y))], 1)
        return self.out(self.bn(self.dw(y))).mean((2, 3))


class MisalignedAddNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 1), nn.Conv2d(3, 8, 1), nn.Conv2d(3, 16, 1)
        self.out = nn.Conv2d(16, 2, 1)

    def forward(self, x):
        return self.out(torch.cat([self.a(x), self.b(x)], 1) + self.c(x)).mean((2, 3))


class ConvOutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x))


# -- helpers ------------------------------------------------------------------------------------

def run(model, x, ratio=0.5, ascend=False, skip=(), ratios=None):
    graph = capture_graph(model, x)
    layers = find_layers(model, graph)
    plan = Plan({n: LayerPlan(n, i.type, {} if n in skip or i.depthwise or i.excluded
                              or i.type not in ("Conv2d", "Linear")
                              else {"filter_prune": FilterSpec((ratios or {}).get(n, ratio), ascend)})
                 for n, i in layers.items()})
    return analyse(graph, layers, plan)


def by_producer(groups):
    return {tuple(g.producer_names): g for g in groups}


def spans(members):
    return {(m.name, m.begin, m.end, m.repeat) for m in members}


# -- tests --------------------------------------------------------------------------------------

def test_residual_add_couples_both_producers():
    groups, blocked = run(ResBlockNet(), example_input("ResBlockNet"))
    g = by_producer(groups)[("stem.0", "conv2")]
    assert g.channels == 16 and g.prune_group == 1
    assert spans(g.consumers) == {("conv1", 0, 16, 1), ("head", 0, 16, 1)}
    assert [m.name for m in g.passive] == ["stem.1", "bn2", "add_0"]  # graph order
    assert ("conv1",) in by_producer(groups) and ("head",) in by_producer(groups)
    assert [(b.producers, b.at) for b in blocked] == [(["fc"], "output")]


def test_mobilenet_residuals_chain_block_outputs():
    groups, _ = run(MobileNetV2Tiny(), example_input("MobileNetV2Tiny"))
    g = by_producer(groups)
    assert ("features.0.0", "features.1.conv.6") in g  # stem + first block's projection (add)
    g24 = g[("features.2.conv.6", "features.3.conv.6")]
    assert spans(g24.consumers) == {("features.3.conv.0", 0, 24, 1), ("features.4.0", 0, 24, 1)}
    hidden = g[("features.1.conv.0",)]
    assert [m.name for m in hidden.passive] == ["features.1.conv.1", "features.1.conv.3", "features.1.conv.4"]


def test_concat_maps_each_branch_to_its_slice():
    groups, blocked = run(ConcatNet(), example_input("ConcatNet"))
    g1, g2 = by_producer(groups)[("branch1.0",)], by_producer(groups)[("branch2.0",)]
    assert spans(g1.consumers) == {("conv", 0, 8, 1)}
    assert spans(g2.consumers) == {("conv", 8, 16, 1)}
    assert ("cat_0", 8, 16, 1) in spans(g2.passive) and ("branch2.1", 0, 8, 1) in spans(g2.passive)
    assert [(b.producers, b.at) for b in blocked] == [(["conv"], "output")]


def test_depthwise_conv_follows_its_input_and_is_never_a_producer():
    groups, _ = run(DepthwiseSeparableNet(), example_input("DepthwiseSeparableNet"))
    g = by_producer(groups)[("conv.0",)]
    assert [m.name for m in g.passive] == ["conv.1", "dw.0", "dw.1"]
    assert [m.group for m in g.passive if m.name == "dw.0"] == [16]
    assert spans(g.consumers) == {("pw", 0, 16, 1)}
    assert all("dw.0" not in gr.producer_names for gr in groups)


def test_global_pool_flatten_linear_feature_mapping():
    groups, _ = run(PoolFlattenLinearNet(), example_input("PoolFlattenLinearNet"))
    assert spans(by_producer(groups)[("conv",)].consumers) == {("fc", 0, 16, 1)}


def test_net001_with_upstream_config():
    model, x = Net001(), example_input("Net001")
    graph = capture_graph(model, x)
    layers = find_layers(model, graph)
    cfg, text = load_config(compat_config("configuration__net_001_prune_complete.cfg"))
    plan = build_plan(cfg, layers, "prune", techniques=TECHNIQUES, text=text)
    groups, blocked = analyse(graph, layers, plan)
    g = by_producer(groups)
    assert set(g) == {("layer2.0",), ("layer5.0",), ("layer6.0",)}  # layer1.0 skipped, fc.* skipped by type
    assert not blocked  # nothing planned is stopped
    l2 = g[("layer2.0",)]
    assert (l2.ratio, l2.ascend_optimized) == (pytest.approx(0.4), False)
    assert [m.name for m in l2.passive] == ["layer2.1", "layer3.0", "layer3.1", "layer4.0", "layer4.1"]
    assert l2.prune_group == 4  # layer5.0 (groups=4) reads these channels: equal removal per group
    assert [(m.name, m.group) for m in l2.consumers] == [("layer5.0", 4)]
    l5 = g[("layer5.0",)]
    assert (l5.ratio, l5.ascend_optimized, l5.prune_group) == (pytest.approx(0.5), True, 8)  # lcm(own groups 4, layer6 groups 8)
    l6 = g[("layer6.0",)]
    assert spans(l6.consumers) == {("fc.0", 0, 2048, 256)}  # non-global flatten: 16x16 per channel
    assert l6.prune_group == 8


def test_transformer_block_prunes_mlp_hidden_only():
    groups, blocked = run(TinyTransformerBlock(), example_input("TinyTransformerBlock"))
    assert [gr.producer_names for gr in groups] == [["fc1"]]
    assert spans(groups[0].consumers) == {("fc2", 0, 64, 1)}
    at = {b.producers[0]: (b.at, b.reason) for b in blocked}
    for name in ("q_proj", "k_proj", "v_proj"):  # heads: the view writes self.heads out
        assert at[name][0].startswith("reshape_") and at[name][1] == (
            "reshape in the top-level module splits the channels into 4 heads of 8 with the head count written "
            "out, and the top-level module has no attribute num_heads/num_attention_heads/n_heads/n_head = 4 to "
            "update: pruned heads cannot be followed")
    assert at["out_proj"][0] == "add_0" and "graph input 'input_0'" in at["out_proj"][1]
    assert at["fc2"][0] == "add_1"


def test_graph_output_blocks_and_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="openamct.sparsity.dependency"):
        groups, blocked = run(ConvOutNet(), torch.randn(1, 3, 6, 6))
    assert groups == [] and len(blocked) == 1
    assert (blocked[0].producers, blocked[0].at) == (["conv"], "output")
    # one WARNING per reason, naming the group and the node that stops it
    assert "group(s) not pruned: 1: the channels reach the graph output [conv (stopped at output)]" in caplog.text


def test_coupled_with_unplanned_layer_blocks_group():
    groups, blocked = run(ResBlockNet(), example_input("ResBlockNet"), skip=("conv2",))
    assert all("stem.0" not in g.producer_names for g in groups)
    (b,) = [b for b in blocked if "stem.0" in b.producers]
    assert set(b.producers) == {"stem.0", "conv2"} and b.at == "conv2"
    assert b.reason == "coupled with conv2, which the config does not prune"


def test_reused_consumer_blocks_group():
    groups, blocked = run(ReusedModuleNet(), example_input("ReusedModuleNet"))
    assert groups == []
    (b,) = blocked
    assert b.producers == ["stem"] and b.at == "shared" and "called 2 times" in b.reason


def test_conv_transpose_is_a_consumer():
    groups, _ = run(UNetTiny(), example_input("UNetTiny"))
    g = by_producer(groups)
    assert spans(g[("enc2.0",)].consumers) == {("up", 0, 32, 1)}
    assert spans(g[("enc1.0",)].consumers) == {("enc2.0", 0, 16, 1), ("dec.0", 16, 32, 1)}  # cat [up, enc1]


def test_channel_gate_couples_but_broadcast_scale_does_not():
    groups, blocked = run(GateNet(), torch.randn(2, 3, 8, 8))
    g = by_producer(groups)
    assert ("conv", "fc2") in g and ("fc1",) in g
    assert spans(g[("conv", "fc2")].consumers) == {("fc1", 0, 32, 1), ("out", 0, 32, 1)}
    assert g[("scale",)].channels == 1 and not g[("scale",)].consumers  # broadcast: coupled with nothing
    assert [b.producers for b in blocked] == [["out"]]


def test_concat_with_input_and_depthwise_multiplier():
    groups, _ = run(DenseCatNet(), torch.randn(1, 3, 6, 6))
    g1, g2 = by_producer(groups)[("c1",)], by_producer(groups)[("c2",)]
    assert spans(g1.consumers) == {("c2", 3, 11, 1), ("out", 6, 22, 2)}
    assert ("dw", 6, 22, 2) in spans(g1.passive)
    assert spans(g2.consumers) == {("out", 22, 38, 2)}


def test_misaligned_add_blocks_all_sides():
    groups, blocked = run(MisalignedAddNet(), torch.randn(1, 3, 4, 4))
    stopped = {p for b in blocked if b.at == "add_0" for p in b.producers}
    assert stopped == {"a", "b", "c"}
    assert [g.producer_names for g in groups] == []


def test_multi_producer_group_takes_min_ratio_and_any_alignment(caplog):
    model, x = EltwiseGroupNet(), example_input("EltwiseGroupNet")
    graph = capture_graph(model, x)
    layers = find_layers(model, graph)
    plan = Plan({"layer1.0": LayerPlan("layer1.0", "Conv2d", {"filter_prune": FilterSpec(0.5, False)}),
                 "layer2.0": LayerPlan("layer2.0", "Conv2d", {"filter_prune": FilterSpec(0.25, True)})})
    with caplog.at_level(logging.INFO, logger="openamct.sparsity.dependency"):
        groups, _ = analyse(graph, layers, plan)
    (g,) = [g for g in groups if len(g.producers) == 2]
    assert (g.ratio, g.ascend_optimized, g.prune_group) == (0.25, True, 2)
    assert "prune_ratio 0.25 (the smallest)" in caplog.text
    assert [m.group for m in g.producers] == [2, 2]


# -- index mapping ------------------------------------------------------------------------------

@pytest.mark.parametrize("src,dst,axis,expect", [
    ((1, 8, 16, 16), (1, 2048), 1, (1, 256)),
    ((2, 8, 1, 1), (2, 8), 1, (1, 1)),
    ((2, 8, 4, 4), (2, 8, 16), 1, (1, 1)),
    ((2, 8, 4, 4), (2, 32, 4), 1, (1, 4)),
    ((2, 5, 32), (10, 32), 2, (1, 1)),
    ((2, 32), (2, 1, 32), 1, (2, 1)),
    ((2, 5, 32), (2, 5, 4, 8), 2, None),
    ((2, 8, 4, 4), (16, 4, 4), 1, None),
])
def test_reshape_axis(src, dst, axis, expect):
    assert reshape_axis(src, dst, axis) == expect


def test_index_axis_and_follow():
    assert index_axis((slice(None), 0), 3, 2) == (1, "")
    assert index_axis((Ellipsis, slice(None, 4)), 3, 2)[0] is None
    assert index_axis((slice(None), None), 2, 1) == (2, "")
    assert follow("mean", ((0,), (2, 3)), {}, (2, 8, 4, 4), (2, 8), 1) == (1, 1)
    assert isinstance(follow("mean", ((0,), 1), {}, (2, 8, 4, 4), (2, 4, 4), 1), str)
    assert follow("transpose", ((0,), 2, 3), {}, (2, 8, 4, 4), (2, 8, 4, 4), 1) == (1, 1)
    # transpose/permute move the channel axis (consumers check the axis they read it on)
    assert follow("permute", ((0,), 0, 2, 3, 1), {}, (2, 8, 4, 4), (2, 4, 4, 8), 1) == (3, 1)
    assert follow("transpose", ((0,), 1, 2), {}, (2, 8, 16), (2, 16, 8), 1) == (2, 1)


def test_segments_concat_expand_and_align():
    a, b = ChannelMap.source(0, 1, 8), ChannelMap.source(1, 1, 24)
    j = ChannelMap.joined(1, [a, 3, b]).expanded(4)
    assert j.size == (8 + 3 + 24) * 4
    assert [(s.gid, off) for s, off in j.placed()] == [(0, 0), (1, 44)]
    assert align(j, j) == [(0, 0), (None, None), (1, 1)]
    assert align(ChannelMap.joined(1, [a, b]), ChannelMap.source(2, 1, 32)) is None
    assert Segment(0, 0, 8, 4).size == 32


def test_plain_conv_chain_gives_one_group_per_conv():
    layers = [nn.Conv2d(3, 16, 3, padding=1)] + [nn.Conv2d(16, 16, 3, padding=1) for _ in range(64)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 2))
    groups, blocked = run(model, torch.randn(1, 3, 4, 4))
    assert len(groups) == 65 and len(blocked) == 1


def test_layers_that_never_ran_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="openamct.sparsity.dependency"):
        groups, _ = run(UntraceableNet(), example_input("UntraceableNet"))  # takes the conv_pos branch
    assert [g.producer_names for g in groups] == [["conv_pos"]]
    assert "'conv_neg' never ran with input_data" in caplog.text
