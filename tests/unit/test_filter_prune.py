"""Balanced L2-norm filter pruning: scores, kept counts, selection and physical removal."""

import copy
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from openamct.config.specs import LayerPlan, Plan
from openamct.graph.capture import capture_graph
from openamct.graph.layers import find_layers
from openamct.sparsity.dependency import analyse
from openamct.sparsity.filter import (
    apply_removal,
    channel_scores,
    kept_count,
    score_and_select,
)
from openamct.techniques.filter_prune import FilterSpec
from tests.models import MODELS, OUTPUT_SHAPES, EltwiseGroupNet, Net001, example_input

# -- models -------------------------------------------------------------------------------------

class FlattenNet(nn.Module):  # non-global flatten: each channel feeds 4x4 Linear features
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 12, 3), nn.BatchNorm2d(12), nn.Linear(12 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).view(x.shape[0], -1))


class ConcatDepthwiseNet(nn.Module):
    """Concat with the graph input, a depthwise conv with channel multiplier 2, a grouped
    consumer of a concat (groups=4 over 8+8 channels), a three-way residual add and a
    ConvTranspose consumer."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.dw, self.bn = nn.Conv2d(27, 54, 3, padding=1, groups=27), nn.BatchNorm2d(54)
        self.mix = nn.Conv2d(54, 16, 1)
        self.c, self.d = nn.Conv2d(3, 8, 1), nn.Conv2d(3, 8, 1)
        self.grouped = nn.Conv2d(16, 16, 1, groups=4)
        self.res = nn.Conv2d(3, 16, 1)
        self.up = nn.ConvTranspose2d(16, 6, 2, stride=2)
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        y = torch.cat([x, F.relu(self.a(x)), F.relu(self.b(x))], 1)
        y = self.mix(F.relu(self.bn(self.dw(y))))
        w = self.grouped(torch.cat([F.relu(self.c(x)), F.relu(self.d(x))], 1))
        y = F.relu(y + w + self.res(x))
        return self.head(F.adaptive_avg_pool2d(self.up(y), 1).flatten(1))


class MlpBlock(nn.Module):  # 3-D Linear input: (batch, tokens, features)
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 64), nn.Linear(64, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x))))).mean(1)


class TwoProducers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.out(self.a(x) + self.b(x)).mean((2, 3))


# -- helpers ------------------------------------------------------------------------------------

def prune(model, x, ratio=0.5, ascend=False):
    graph = capture_graph(model, x)
    layers = find_layers(model, graph)
    plan = Plan({n: LayerPlan(n, i.type, {"filter_prune": FilterSpec(ratio, ascend)})
                 for n, i in layers.items() if i.type in ("Conv2d", "Linear") and not i.depthwise})
    groups, _ = analyse(graph, layers, plan)
    score_and_select(model, groups)
    return groups


def randomise_bn(model):
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def zero_removed_inputs(model, groups):
    """Make the removed channels irrelevant in the unpruned model: the pruned model must
    then compute exactly the same function (checks every index mapping end to end)."""
    mods = dict(model.named_modules())
    with torch.no_grad():
        for g in groups:
            for m in g.consumers:
                mod, pos = mods[m.name], m.positions(g.removed)
                if isinstance(mod, nn.Linear):
                    mod.weight[:, pos] = 0
                elif isinstance(mod, nn.ConvTranspose2d):
                    mod.weight[pos] = 0
                else:
                    cin_g, cout_g = mod.in_channels // mod.groups, mod.out_channels // mod.groups
                    for p in pos:
                        blk = p // cin_g
                        mod.weight[blk * cout_g:(blk + 1) * cout_g, p % cin_g] = 0


ZOO = ["Net001", "ResBlockNet", "ConcatNet", "DepthwiseSeparableNet", "PoolFlattenLinearNet",
       "TinyTransformerBlock", "MobileNetV2Tiny", "UNetTiny", "EltwiseGroupNet"]
CASES = [(MODELS[n], (2, *example_input(n).shape[1:])) for n in ZOO] + [
    (FlattenNet, (2, 3, 6, 6)), (ConcatDepthwiseNet, (2, 3, 6, 6)), (MlpBlock, (2, 5, 16))]


# -- tests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,ratio,ascend,group,kept", [
    (160, 0.25, False, 2, 120), (160, 0.25, True, 2, 128), (64, 0.3, False, 1, 45), (64, 0.3, True, 1, 48),
    (16, 0.4, False, 4, 12), (8, 0.5, True, 8, 8), (10, 0.5, True, 1, 10), (3, 0.9, False, 1, 1),
])
def test_kept_count(n, ratio, ascend, group, kept):
    assert kept_count(n, ratio, ascend, group) == kept


def test_channel_scores_are_normalised_and_equal_weights_give_no_nan():
    w = torch.stack([torch.full((3, 2, 2), float(v)) for v in (1, 3, 2)])
    assert channel_scores(w).tolist() == pytest.approx([0.0, 1.0, 0.5])
    flat = channel_scores(torch.ones(5, 4))
    assert not torch.isnan(flat).any() and flat.tolist() == [0.0] * 5


def test_eltwise_group_keeps_120_with_identical_indices():
    model = EltwiseGroupNet().eval()
    groups = prune(model, example_input("EltwiseGroupNet"), ratio=0.25, ascend=False)
    (g,) = [g for g in groups if len(g.producers) == 2]
    assert g.prune_group == 2 and len(g.removed) == 40
    assert sum(1 for c in g.removed if c < 80) == 20  # equal removal in both conv groups
    before = copy.deepcopy(model)
    apply_removal(model, groups)
    kept = [c for c in range(160) if c not in g.removed]
    for name in ("layer1", "layer2"):
        conv, old = getattr(model, name)[0], getattr(before, name)[0]
        assert conv.out_channels == 120 and conv.weight.shape == (120, 8, 3, 3)
        assert torch.equal(conv.weight, old.weight[kept])
        assert torch.equal(getattr(model, name)[1].running_mean, getattr(before, name)[1].running_mean[kept])
    assert model.layer3[0].in_channels == 120 and model.layer3[0].weight.shape == (32, 60, 3, 3)
    assert model(example_input("EltwiseGroupNet")).shape == OUTPUT_SHAPES["EltwiseGroupNet"]


def test_ascend_optimized_keeps_multiples_of_16():
    pruned = []
    for name in ("Net001", "MobileNetV2Tiny", "UNetTiny"):
        groups = prune(MODELS[name]().eval(), example_input(name), ratio=0.3, ascend=True)
        pruned += [g for g in groups if g.removed]
    assert len(pruned) >= 3  # 16- and 32-channel layers stay whole: 0.3 never frees 16 of them
    assert all((g.channels - len(g.removed)) % 16 == 0 for g in pruned)
    (g,) = [g for g in prune(EltwiseGroupNet(), example_input("EltwiseGroupNet"), 0.25, True)
            if len(g.producers) == 2]
    assert 160 - len(g.removed) == 128


def test_multi_producer_group_sums_the_scores_of_all_producers():
    model = TwoProducers()
    with torch.no_grad():
        for conv, norms in ((model.a, [1.0, 1.1, 2.0, 2.0]), (model.b, [2.0, 1.0, 2.0, 2.0])):
            conv.weight.zero_()
            conv.weight[:, 0, 0, 0] = torch.tensor(norms)
    assert int(channel_scores(model.a.weight).argmin()) == 0  # the first producer alone drops 0
    (g,) = [g for g in prune(model, torch.randn(1, 3, 4, 4), ratio=0.25) if len(g.producers) == 2]
    assert g.removed == [1]


def test_ties_remove_the_lower_index_first():
    model = TwoProducers()
    with torch.no_grad():
        model.a.weight.fill_(1.0)
        model.b.weight.fill_(1.0)
    (g,) = [g for g in prune(model, torch.randn(1, 3, 4, 4), ratio=0.5) if len(g.producers) == 2]
    assert g.removed == [0, 1]


@pytest.mark.parametrize("cls,shape", CASES, ids=[c.__name__ for c, _ in CASES])
def test_pruned_model_computes_the_same_function_when_removed_inputs_are_zero(cls, shape):
    torch.manual_seed(1)
    model, x = randomise_bn(cls()), torch.randn(*shape)
    groups = prune(model, x, ratio=0.4)
    assert any(g.removed for g in groups)
    zero_removed_inputs(model, groups)
    params = sum(p.numel() for p in model.parameters())
    pruned = copy.deepcopy(model)
    apply_removal(pruned, groups)
    with torch.no_grad():
        ref, out = model(x), pruned(x)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert sum(p.numel() for p in pruned.parameters()) < params
    for m in pruned.modules():  # attributes agree with the tensors
        if isinstance(m, nn.Conv2d):
            assert m.weight.shape[:2] == (m.out_channels, m.in_channels // m.groups)
        if isinstance(m, nn.Linear):
            assert m.weight.shape == (m.out_features, m.in_features)
        if isinstance(m, nn.BatchNorm2d):
            assert m.running_var.shape == (m.num_features,)


def test_depthwise_grouped_and_transposed_layers_stay_consistent():
    model = randomise_bn(ConcatDepthwiseNet())
    groups = prune(model, torch.randn(1, 3, 6, 6), ratio=0.5)
    by = {tuple(g.producer_names): g for g in groups}
    assert by[("c",)].prune_group == by[("d",)].prune_group == 2  # 'grouped' has 4 groups over 8+8
    assert set(by) >= {("a",), ("b.0",), ("mix", "grouped", "res")}
    apply_removal(model, groups)
    dw = model.dw
    assert dw.in_channels == 3 + 4 + 8 and dw.groups == dw.in_channels
    assert dw.out_channels == dw.weight.shape[0] == 2 * dw.in_channels  # upstream left out_channels stale
    assert model.grouped.weight.shape == (8, 2, 1, 1) and model.grouped.in_channels == 8
    assert model.up.in_channels == model.up.weight.shape[0] == 8


def test_parameters_are_new_and_keep_requires_grad():
    model = FlattenNet()
    model.conv.bias.requires_grad_(False)
    old = model.conv.weight
    groups = prune(model, torch.randn(1, 3, 6, 6), ratio=0.5)
    apply_removal(model, groups)
    assert isinstance(model.conv.weight, nn.Parameter) and model.conv.weight is not old
    assert model.conv.weight.requires_grad and not model.conv.bias.requires_grad
    assert model.fc.weight.shape == (5, 6 * 16)
    loss = model(torch.randn(2, 3, 6, 6)).sum()
    loss.backward()
    assert model.conv.weight.grad.shape == model.conv.weight.shape


def test_removal_keeps_the_counts_of_a_coupled_group():
    model = EltwiseGroupNet()
    groups = prune(model, example_input("EltwiseGroupNet"), ratio=0.25)
    apply_removal(model, groups)
    assert model.layer1[0].out_channels == 120 and model.layer3[0].in_channels == 120
    assert model.layer1[1].num_features == 120


def test_onnx_export_has_smaller_tensors(tmp_path):
    model, x = randomise_bn(Net001()), example_input("Net001")
    params = sum(p.numel() for p in model.parameters())
    groups = prune(model, x, ratio=0.5)
    apply_removal(model, groups)
    path = str(tmp_path / "pruned.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"])
    inits = onnx.load(path).graph.initializer
    shapes = {i.name: tuple(i.dims) for i in inits}
    dims = set(shapes.values())  # the exporter folds conv BatchNorms and renames those weights
    assert shapes["fc.0.weight"] == (512, 8 * 16 * 16)  # fc.0 halves; layer6 keeps all 8 channels (groups=8)
    assert (512, 64) in dims and shapes["fc.5.weight"] == (10, 64)  # fc.2 as a transposed MatMul
    assert (16, 2, 3, 3) in dims  # layer5: 32 -> 16 outputs, 4 -> 2 inputs per group (layer2 16 -> 8)
    assert sum(int(np.prod(i.dims)) for i in inits) < params / 2
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ref = model(x).numpy()
    np.testing.assert_allclose(sess.run(None, {"x": x.numpy()})[0], ref, rtol=1e-4, atol=1e-5)


def test_apply_removal_rejects_unequal_removal_in_a_grouped_conv():
    model = EltwiseGroupNet()
    groups = prune(model, example_input("EltwiseGroupNet"), ratio=0.25)
    (g,) = [g for g in groups if len(g.producers) == 2]
    g.removed = list(range(40))  # all from the first conv group
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="layer1.0.*same number"):
        apply_removal(model, groups)
    after = model.state_dict()  # checked before anything was edited
    assert all(torch.equal(before[k], after[k]) for k in before) and model.layer1[1].num_features == 160
