"""The search modes of amct.prune: tolerance (masks where the method selects, copies where it
rewrites), size budget, sensitivity allocation, the menu; and prune_diagnose, prune_finetune,
accuracy_based_auto_prune."""

import copy

import pytest
import torch
from prune_family_models import calib, logits, ort_matches, reload_same, tiny

import openamct as amct
from openamct.pruning import (
    DENSE_LOWVAR_PRUNE_CFG,
    DENSE_RECOVERY_MENU_CFG,
    SENSITIVITY_ALLOC_PRUNE_CFG,
    PruneReport,
    quality,
)


def _agreement(a, b, x):
    return float((logits(a, x).argmax(-1) == logits(b, x).argmax(-1)).float().mean())


def test_tolerance_picks_the_largest_ratio_within_the_drop_by_masks(monkeypatch):
    model, data = tiny("llama"), calib()
    orig = copy.deepcopy(model)
    copies = []
    real = copy.deepcopy
    monkeypatch.setattr(quality.copy, "deepcopy", lambda m, *a: copies.append(1) or real(m, *a))
    rep = PruneReport()
    amct.prune(model, DENSE_LOWVAR_PRUNE_CFG, data=data, tolerance=0.05, ratio_grid=[0.1, 0.3, 0.5, 0.7, 0.9],
               report=rep)
    assert not copies, "a selection method's search must not copy the model"
    trials = {float(e.module.split("=")[1]): e.detail for e in rep.events if e.stage == "search"}
    assert rep.chosen_ratio in trials and "accepted" in trials[rep.chosen_ratio]
    assert all("rejected" in d for r, d in trials.items() if r > rep.chosen_ratio)
    agree = sum(_agreement(model, orig, x) for x in data) / len(data)
    assert agree >= 0.95 - 1e-6
    assert model.config.intermediate_size == 64 - round(rep.chosen_ratio * 64)


def test_tolerance_with_a_rewriting_method_or_finetune_fn_tries_copies(tmp_path):
    model, data = tiny("qwen2"), calib()
    seen = []
    cfg = {"methods": {"dense": {"name": "reconstruct", "kwargs": {"prune_ratio": 0.5}}}}
    amct.prune(model, cfg, data=data, tolerance=1.0, ratio_grid=[0.25, 0.5],
               finetune_fn=lambda m: seen.append(m is model))
    assert seen and not any(seen), "finetune_fn runs on candidate copies, never on the caller's model"
    assert model.config.intermediate_size == 32
    assert reload_same(model, tmp_path, data[0]) < 1e-5


def test_an_evaluator_object_drives_the_search_and_a_failing_candidate_is_rejected():
    class Ev:
        def evaluate(self, m):
            w = m.model.layers[0].mlp.down_proj.in_features
            return 1.0 if w >= 48 else 0.0

    model = tiny("llama")
    res = amct.accuracy_based_auto_prune(model, DENSE_LOWVAR_PRUNE_CFG, data=calib(), tolerance=0.0,
                                         evaluator=Ev(), ratio_grid=[0.1, 0.2, 0.3, 0.5], finetune_fn=lambda m: None)
    assert res.chosen_ratio == 0.2 and res.applied
    assert model.model.layers[0].mlp.down_proj.in_features == 64 - round(0.2 * 64)
    assert "applied prune_ratio=0.20" in res.summary()


def test_apply_false_only_reports():
    model = tiny("llama")
    res = amct.accuracy_based_auto_prune(model, DENSE_LOWVAR_PRUNE_CFG, data=calib(), tolerance=0.5, apply=False)
    assert res.chosen_ratio is not None and not res.applied
    assert model.config.intermediate_size == 64 and model.model.layers[0].mlp.down_proj.in_features == 64


def test_size_budget_keeps_at_most_the_share_of_parameters():
    model = tiny("mistral")
    before = sum(p.numel() for p in model.parameters())
    rep = PruneReport()
    amct.prune(model, DENSE_LOWVAR_PRUNE_CFG, data=calib(), size_budget=0.9, report=rep)
    after = sum(p.numel() for p in model.parameters())
    assert after <= 0.9 * before and rep.params_after == after
    assert 0 < rep.prunable_fraction < 1 and not rep.budget_unreachable
    # one channel fewer would have done: the ratio found is the smallest that meets the budget
    per_channel = 3 * 32
    assert after > 0.9 * before - 2 * per_channel * 2


def test_an_unreachable_size_budget_is_flagged_and_the_grid_maximum_applied():
    model = tiny("llama")
    rep = PruneReport()
    amct.prune(model, DENSE_LOWVAR_PRUNE_CFG, data=calib(), size_budget=0.1, ratio_grid=[0.2, 0.6], report=rep)
    assert rep.budget_unreachable and rep.chosen_ratio == 0.6
    assert any("out of reach" in w for w in rep.warnings)
    assert model.config.intermediate_size == 64 - round(0.6 * 64)


def test_sensitivity_allocation_gives_layers_their_own_ratio_and_says_so():
    model = tiny("llama")
    with torch.no_grad():  # make layer 1's FFN matter far more than layer 0's
        model.model.layers[1].mlp.down_proj.weight.mul_(20)
    rep = PruneReport()
    cfg = copy.deepcopy(SENSITIVITY_ALLOC_PRUNE_CFG)
    cfg["allocation"]["guard"] = "none"
    amct.prune(model, cfg, data=calib(), report=rep)
    w0 = model.model.layers[0].mlp.down_proj.in_features
    w1 = model.model.layers[1].mlp.down_proj.in_features
    assert rep.allocation_choice == "sensitivity"
    assert w0 < w1, (w0, w1)
    assert model.config.intermediate_size == 64, "unequal widths: the field is left, with a warning"
    assert any("different widths" in w for w in rep.warnings)


def test_the_sensitivity_guard_keeps_uniform_unless_allocation_is_better():
    model = tiny("llama")
    rep = PruneReport()
    amct.prune(model, SENSITIVITY_ALLOC_PRUNE_CFG, data=calib(), report=rep)
    guard = [e.detail for e in rep.events if e.stage == "guard"]
    s, u = (float(v.split()[1]) for v in guard[0].split(" vs "))
    assert rep.allocation_choice == ("sensitivity" if s < u else "uniform")


def test_the_recovery_menu_keeps_the_fallback_unless_a_candidate_beats_it(tmp_path):
    model = tiny("llama")
    rep = PruneReport()
    amct.prune(model, DENSE_RECOVERY_MENU_CFG, data=calib(n=6), eval_data=calib(n=2, seed=5), report=rep)
    menu = {e.module: float(e.detail.split()[1]) for e in rep.events if e.stage == "menu" and e.method != "choice"}
    choice = [e.detail for e in rep.events if e.method == "choice"][0]
    assert set(menu) == {"none", "bias", "ls"}
    best = max(menu, key=lambda k: (menu[k], k == "none"))
    assert choice == (best if menu[best] > menu["none"] else "none")
    assert model.config.intermediate_size == 32
    assert ort_matches(model, tmp_path, calib(n=1)[0]) < 1e-4


def test_prune_diagnose_leaves_the_model_and_reports():
    model = tiny("llama")
    state = copy.deepcopy(model.state_dict())
    d = amct.prune_diagnose(model, calib(), config=DENSE_LOWVAR_PRUNE_CFG, prune_ratio=0.5, tolerance=0.2)
    assert d.targets["dense"] == 2 and d.prune_works and d.prune_forward_ok
    assert 0 < d.prune_reduction < 0.5 and d.search_works
    assert "dense=2" in d.summary()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_prune_finetune_against_the_original_brings_outputs_closer():
    model, data = tiny("llama"), calib(n=4)
    teacher = copy.deepcopy(model)
    amct.prune(model, DENSE_LOWVAR_PRUNE_CFG, data=data)
    err = lambda: sum(float(((logits(model, x) - logits(teacher, x)) ** 2).mean()) for x in data)  # noqa: E731
    before = err()
    out = amct.prune_finetune(model, data, steps=40, lr=1e-4, teacher=teacher)
    assert out["steps"] == 40 and out["final_loss"] < out["initial_loss"]
    assert err() < 0.5 * before
    assert not model.training


def test_prune_finetune_default_loss_is_the_language_model_loss():
    model = tiny("llama")
    out = amct.prune_finetune(model, calib(n=2, kind="dict"), steps=3)
    assert out["steps"] == 3 and out["initial_loss"] > 0
    with pytest.raises(ValueError, match="pass loss_fn"):
        amct.prune_finetune(tiny("bert"), calib(n=1), steps=1)
