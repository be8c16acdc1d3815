"""amct.prune on MoE experts: Mixtral, Qwen2-MoE (shared expert kept), OLMoE from small configs and
a hand-written ModuleList MoE; router shrunk, config counts rewritten, reloadable, exportable."""

import copy

import pytest
import torch
from prune_family_models import calib, logits, ort_matches, reload_same, tiny
from torch import nn

import openamct as amct
from openamct.pruning import MOE_MASSVAR_PRUNE_CFG, MOE_OUTPUT_MERGE_PRUNE_CFG, PruneReport, core
from openamct.pruning.config import parse_config
from openamct.pruning.presets import MOE_VARIANCE_MENU_CFG

COUNT = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "olmoe": "num_experts"}
VARIANCE = {"methods": {"moe": {"name": "mass_variance",
                                "kwargs": {"prune_ratio": 0.5, "boundary": -1, "variance_score": "cvxpeak"}}}}


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("cfg", [MOE_MASSVAR_PRUNE_CFG, VARIANCE, MOE_OUTPUT_MERGE_PRUNE_CFG],
                         ids=["mass", "variance", "merge"])
def test_experts_removed_router_shrunk_config_rewritten_reload_export(kind, cfg, tmp_path):
    model = tiny(kind)
    same = model
    x = calib(n=1, seed=9)[0]
    rep = PruneReport()
    amct.prune(model, cfg, data=calib(), report=rep)
    assert model is same
    assert getattr(model.config, COUNT[kind]) == 4 and model.config.num_experts_per_tok == 2
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.shape == (4, 32)
        assert all(p.shape[0] == 4 for p in layer.mlp.experts.parameters(recurse=False))
    assert set(rep.per_layer_sparsity) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    if cfg is MOE_OUTPUT_MERGE_PRUNE_CFG:
        assert {e.detail for e in rep.events if e.stage == "recover"} <= {"merge", "drop"}
        assert len([e for e in rep.events if e.stage == "recover"]) == 2
    assert reload_same(model, tmp_path, x) < 1e-5
    assert ort_matches(model, tmp_path, x) < 1e-4


def test_qwen2_moe_keeps_its_shared_expert_whole():
    model = tiny("qwen2_moe")
    shared = copy.deepcopy(model.model.layers[0].mlp.shared_expert.state_dict())
    amct.prune(model, MOE_MASSVAR_PRUNE_CFG, data=calib())
    after = model.model.layers[0].mlp.shared_expert.state_dict()
    assert all(torch.equal(shared[k], v) for k, v in after.items())


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_masked_trial_routes_as_the_cut_model(kind):
    model, data = tiny(kind), calib()
    targets = core.prepare(model, parse_config(MOE_MASSVAR_PRUNE_CFG), data, PruneReport())
    keeps = [core.keep_masks(t, 0.75) for t in targets]
    with core.masked(model, targets, keeps):
        masked = [logits(model, x) for x in data]
    core.apply(model, targets, keeps, data, PruneReport())
    assert model.config.num_experts_per_tok == 2
    assert all(torch.allclose(logits(model, x), m, atol=1e-5) for x, m in zip(data, masked))


def test_pruning_below_top_k_lowers_it_everywhere():
    model = tiny("mixtral")
    amct.prune(model, {"methods": {"moe": {"name": "activation_count", "kwargs": {"prune_ratio": 0.9}}}},
               data=calib())
    assert model.config.num_local_experts == 1 and model.config.num_experts_per_tok == 1
    assert model.model.layers[0].mlp.gate.top_k == 1
    assert torch.isfinite(logits(model, calib(n=1)[0])).all()


def test_the_mass_criterion_keeps_the_experts_the_router_favours():
    model = tiny("olmoe")
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight[5].mul_(30)  # expert 5 wins most tokens of layer 0
    targets = core.prepare(model, parse_config(MOE_MASSVAR_PRUNE_CFG), calib(), PruneReport())
    scores = targets[0].scores["model.layers.0.mlp"]
    assert int(scores.argmax()) == 5


def test_the_variance_menu_picks_a_criterion_and_prunes():
    model = tiny("mixtral")
    rep = PruneReport()
    amct.prune(model, MOE_VARIANCE_MENU_CFG, data=calib(n=4), eval_data=calib(n=2, seed=3), report=rep)
    assert {e.module for e in rep.events if e.stage == "menu" and e.method != "choice"} == {
        "mass", "cond_var", "peak", "cvxpeak"}
    assert model.config.num_local_experts == 4


class ListMoE(nn.Module):
    """A hand-written MoE: a Linear router over a ModuleList of experts, top-2 softmax routing."""

    def __init__(self, h=16, n=6):
        super().__init__()
        self.top_k, self.num_experts = 2, n
        self.gate = nn.Linear(h, n, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 24), nn.GELU(), nn.Linear(24, h)) for _ in range(n))

    def forward(self, x):
        t = x.reshape(-1, x.shape[-1])
        w, i = torch.topk(torch.softmax(self.gate(t), -1), self.top_k, -1)
        out = torch.zeros_like(t)
        for e, expert in enumerate(self.experts):
            sel = (i == e)
            rows = sel.any(-1)
            if rows.any():
                out[rows] += expert(t[rows]) * (w * sel).sum(-1, keepdim=True)[rows]
        return x + out.reshape(x.shape)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(ListMoE(), ListMoE())
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.blocks(x))


def test_a_hand_written_modulelist_moe_is_pruned_and_exports(tmp_path):
    import onnxruntime as ort

    torch.manual_seed(0)
    net = Net().eval()
    data = [torch.randn(4, 7, 16) for _ in range(3)]
    targets = core.prepare(net, parse_config(MOE_MASSVAR_PRUNE_CFG), data, PruneReport())
    keeps = [core.keep_masks(t, 0.5) for t in targets]
    with core.masked(net, targets, keeps), torch.no_grad():
        masked = net(data[0])
    core.apply(net, targets, keeps, data, PruneReport())
    assert len(net.blocks[0].experts) == 3 and net.blocks[0].gate.out_features == 3
    assert net.blocks[0].num_experts == 3
    with torch.no_grad():
        assert torch.allclose(net(data[0]), masked, atol=1e-5)
        path = str(tmp_path / "moe.onnx")
        torch.onnx.export(net, (data[0],), path, input_names=["x"], opset_version=17, dynamo=False)
        got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": data[0].numpy()})[0]
        assert abs(got - net(data[0]).numpy()).max() < 1e-4
