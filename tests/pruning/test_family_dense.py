"""amct.prune on dense FFN widths: Llama/Qwen2/Mistral gate/up/down and BERT intermediate/output,
in place, config rewritten, reloadable, exportable; the config checks; reconstruction helps."""

import copy

import pytest
import torch
from prune_family_models import calib, logits, ort_matches, reload_same, tiny

import openamct as amct
from openamct.pruning import DENSE_LOWVAR_PRUNE_CFG, PruneReport, core
from openamct.pruning.config import parse_config


def _dense(method, ratio=0.5, **kw):
    return {"methods": {"dense": {"name": method, "kwargs": {"prune_ratio": ratio, **kw}}}}


def _ffn_widths(model):
    return sorted({m.in_features for n, m in model.named_modules()
                   if n.endswith(("down_proj", "output.dense")) and "attention" not in n})


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "bert"])
@pytest.mark.parametrize("method", ["low_variance", "reconstruct"])
def test_dense_prune_in_place_config_rewritten_reloads_and_exports(kind, method, tmp_path):
    model = tiny(kind)
    data = calib(kind="dict" if kind == "bert" else "ids")
    x = calib(n=1, seed=7)[0]
    before = logits(model, x)
    same = model
    rep = PruneReport()
    amct.prune(model, _dense(method), data=data, report=rep)
    assert model is same
    assert _ffn_widths(model) == [32]
    assert model.config.intermediate_size == 32
    assert rep.params_after < rep.params_before == sum(p.numel() for p in tiny(kind).parameters())
    assert rep.backend == "huggingface" and len(rep.per_layer_sparsity) == 2
    assert all(0.3 < s < 0.7 for s in rep.per_layer_sparsity.values())
    assert logits(model, x).shape == before.shape
    assert reload_same(model, tmp_path, x) < 1e-5
    assert ort_matches(model, tmp_path, x) < 1e-4


def test_the_preset_cuts_half_and_leaves_attention_alone():
    model = tiny("llama")
    q = model.model.layers[0].self_attn.q_proj.weight.clone()
    amct.prune(model, DENSE_LOWVAR_PRUNE_CFG, data=calib())
    assert model.config.intermediate_size == 32
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, q)


def test_a_masked_trial_is_the_applied_cut():
    """The search measures candidates by masks: they must compute what the cut model computes."""
    model, data = tiny("llama"), calib()
    cfg = parse_config(_dense("low_variance", 0.4))
    targets = core.prepare(model, cfg, data, PruneReport())
    keeps = [core.keep_masks(t, 0.4) for t in targets]
    with core.masked(model, targets, keeps):
        masked = logits(model, data[0])
    core.apply(model, targets, keeps, data, PruneReport())
    assert torch.allclose(logits(model, data[0]), masked, atol=1e-5)
    assert model.config.intermediate_size == 64 - round(0.4 * 64)


def test_least_squares_recovery_beats_slicing_on_the_same_channels():
    data = calib(n=8)
    errs = {}
    for recovery in ("none", "ls"):
        model = tiny("llama")
        ref = [logits(model, x) for x in data]
        amct.prune(model, _dense("reconstruct", 0.5, recovery=recovery), data=data)
        errs[recovery] = sum(float(((logits(model, x) - r) ** 2).mean()) for x, r in zip(data, ref))
    assert errs["ls"] < 0.8 * errs["none"], errs


def test_bias_recovery_folds_the_mean_into_bert_output_bias():
    model = tiny("bert")
    b = model.encoder.layer[0].output.dense.bias.clone()
    amct.prune(model, _dense("reconstruct", 0.5, recovery="bias"), data=calib(kind="dict"))
    assert not torch.allclose(model.encoder.layer[0].output.dense.bias, b)


def test_skip_layers_leaves_a_layer_whole_and_the_config_field_alone():
    model = tiny("llama")
    rep = PruneReport()
    cfg = {**_dense("low_variance"), "skip_layers": ["layers.1."]}
    amct.prune(model, cfg, data=calib(), report=rep)
    assert model.model.layers[0].mlp.down_proj.in_features == 32
    assert model.model.layers[1].mlp.down_proj.in_features == 64
    assert model.config.intermediate_size == 64
    assert any("different widths" in w for w in rep.warnings)


@pytest.mark.parametrize("config, match", [
    (_dense("low_variance", prune_rate=0.3), r"unknown key\(s\) \['prune_rate'\].*accepted: \['prune_ratio'\]"),
    ({"methods": {"dense": "low_var"}}, r"unknown method 'low_var'.*\['low_variance', 'reconstruct'\]"),
    ({"methods": {"ffn": "low_variance"}}, r"unknown domain\(s\) \['ffn'\]"),
    ({"methods": {"dense": "low_variance"}, "skip": []}, r"unknown key\(s\) \['skip'\]"),
    (_dense("low_variance", 1.0), r"prune_ratio=1.0 is outside \[0, 1\)"),
    (_dense("reconstruct", recovery="lsq"), r"recovery='lsq' is not one of"),
])
def test_bad_configs_are_refused_before_any_work(config, match):
    model = tiny("llama")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        amct.prune(model, config, data=calib())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_calls_are_refused():
    model = tiny("llama")
    with pytest.raises(ValueError, match="data= is required"):
        amct.prune(model, DENSE_LOWVAR_PRUNE_CFG)
    with pytest.raises(ValueError, match="evaluator, ratio_grid only apply to a search mode"):
        amct.prune(model, DENSE_LOWVAR_PRUNE_CFG, data=calib(), evaluator=lambda m: 1.0, ratio_grid=[0.1])
    with pytest.raises(ValueError, match="only one of tolerance= and size_budget="):
        amct.prune(model, data=calib(), tolerance=0.1, size_budget=0.5)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        amct.prune("model", data=calib())
    assert model.config.intermediate_size == 64


def test_the_caller_config_dict_is_not_modified():
    cfg = copy.deepcopy(DENSE_LOWVAR_PRUNE_CFG)
    amct.prune(tiny("llama"), cfg, data=calib(), tolerance=0.5)
    assert cfg == DENSE_LOWVAR_PRUNE_CFG
