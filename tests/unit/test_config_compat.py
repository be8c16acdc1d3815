"""Every upstream sample config gives the outcome amct-compat/README.md states, on Net001."""

import glob
import os

import pytest
import torch

from openamct import pipeline
from openamct.techniques.filter_prune import FilterSpec
from openamct.techniques.sparsity24 import NMSpec
from tests.conftest import COMPAT, compat_config
from tests.models import Net001

X = torch.randn(1, 2, 28, 28)


def plan_for(cfg: str, api: str):
    return pipeline.analyse(Net001(), X, compat_config(cfg), api).plan


def prune_of(plan):
    return {n: lp.prune for n, lp in plan.layers.items()}


PRUNE_COMPLETE = {
    "layer1.0": None, "layer2.0": FilterSpec(0.4, False), "layer3.0": None, "layer4.0": None,
    "layer5.0": FilterSpec(0.5, True), "layer6.0": FilterSpec(0.5, True), "fc.0": None, "fc.2": None, "fc.5": None,
}


@pytest.mark.parametrize("api", ["prune", "compressed"])
@pytest.mark.parametrize("cfg", ["configuration__net_001_prune_complete.cfg",
                                 "configuration__net_001_prune_skip_override_repeated.cfg"])
def test_prune_complete_plan(cfg, api):
    plan = plan_for(cfg, api)
    assert prune_of(plan) == PRUNE_COMPLETE
    assert not plan.quantized()
    assert any("skip" in note for note in plan.layers["layer1.0"].notes)
    assert any("depthwise" in note for note in plan.layers["layer3.0"].notes)


def test_quant_has_prune_accepted_by_compressed_api_with_same_prune_plan():
    assert prune_of(plan_for("configuration__net_001_quant_has_prune.cfg", "compressed")) == PRUNE_COMPLETE


def test_quant_has_prune_rejected_by_quant_api():
    with pytest.raises(ValueError, match="pruning fields in a quantization-only config"):
        plan_for("configuration__net_001_quant_has_prune.cfg", "quant")


def test_prune_has_quant_rejected_by_prune_api_pointing_to_compressed():
    with pytest.raises(ValueError, match="create_compressed_retrain_model"):
        plan_for("configuration__net_001_prune_has_quant.cfg", "prune")


@pytest.mark.parametrize("api", ["prune", "compressed"])
@pytest.mark.parametrize("cfg,pattern", [
    ("configuration__net_001_prune_empty_001.cfg", r"filter_pruner is empty"),
    ("configuration__net_001_prune_empty_002.cfg", r"nothing to do"),
    ("configuration__net_001_prune_miss_ratio.cfg", r"line 4:\d+: required field 'prune_ratio' is missing"),
    ("configuration__net_001_prune_unsupport_type.cfg", r"line 26:\d+: .*'conv' is not a supported layer type"),
    ("configuration__net_001_prune_no_layer.cfg", r"layer 'layer2.3' does not exist.*did you mean 'layer2.0'"),
])
def test_rejected_prune_configs(cfg, pattern, api):
    with pytest.raises(ValueError, match=pattern):
        plan_for(cfg, api)


@pytest.mark.parametrize("cfg,pattern", [
    ("configuration__compressed_cfg__net_001_compressed_empty.cfg", "nothing to do"),
    ("configuration__compressed_cfg__net_001_compressed_quant_only_skip_layers.cfg", "'layer1.0' is not a supported layer type"),
    ("configuration__compressed_cfg__net_001_compressed_quant_only_skip_layer_types.cfg", "nothing to do"),
    ("configuration__precision_mode_fp16.cfg", "nothing to do"),
])
def test_rejected_compressed_configs(cfg, pattern):
    with pytest.raises(ValueError, match=pattern):
        plan_for(cfg, "compressed")


def test_nochannelwise_quantizes_everything_with_per_type_defaults():
    plan = plan_for("configuration__compressed_cfg__net_001_compressed_quant_only_data_weight_nochannelwise.cfg", "compressed")
    assert len(plan.quantized()) == 9
    for lp in plan.quantized():
        assert (lp.quant.act.clip_max, lp.quant.act.clip_min) == (6.0, -6.0)
        assert lp.quant.wts.algo == "arq"
        assert lp.quant.wts.channel_wise is (lp.type != "Linear")
    assert not plan.filter_pruned() and not plan.nm_pruned()


def test_channel_wise_linear_is_accepted_as_per_channel():
    plan = plan_for("configuration__compressed_cfg__net_001_compressed_quant_only_data_weight.cfg", "compressed")
    assert all(lp.quant.wts.channel_wise for lp in plan.quantized())
    assert plan.layers["fc.0"].quant.wts.channel_wise


def test_override_layer_types_prunes_and_quantizes_layer1():
    plan = plan_for("configuration__compressed_cfg__net_001_compressed_quant_only_override_layer_configs.cfg", "compressed")
    lp = plan.layers["layer1.0"]
    assert lp.prune == FilterSpec(0.5, True)
    assert lp.quant is not None and lp.quant.act.clip_max == 6.0
    assert plan.layers["fc.0"].quant is None


def test_quant_only_complete_override_reenables_skipped_layers():
    plan = plan_for("configuration__compressed_cfg__net_001_compressed_quant_only_complete.cfg", "compressed")
    assert plan.layers["layer2.0"].quant.act.clip_max == 5.0  # layer override wins
    assert plan.layers["layer1.0"].quant is not None  # skipped, re-enabled by the Conv2d type override
    assert plan.layers["layer1.0"].quant.act.clip_max is None  # type override has no data half: defaults
    assert plan.layers["fc.0"].quant.act.clip_max == 6.0  # global


def test_compressed_complete_skip_types_win_for_pruning():
    plan = plan_for("configuration__compressed_cfg__net_001_compressed_complete.cfg", "compressed")
    assert not plan.filter_pruned()  # Conv2d and Linear are both skipped for pruning
    assert len(plan.quantized()) == 9


def test_mixed_nm_global_with_filter_override():
    plan = plan_for("single_file__test_prune_interface__model_003_prune.cfg", "prune")
    assert plan.layers["layer1.0"].prune == FilterSpec(0.5, False)
    assert plan.layers["layer2.0"].prune == NMSpec(update_freq=1)
    assert plan.layers["layer3.0"].prune is None  # depthwise: Cin per group 1


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(COMPAT, "configs", "single_file__*.cfg"))
                         + glob.glob(os.path.join(COMPAT, "configs", "prune__*.cfg"))))
def test_interface_configs_are_accepted(path):
    api = "compressed" if "compressed" in os.path.basename(path) else "prune"
    plan = pipeline.analyse(Net001(), X, path, api).plan
    assert not plan.is_empty()
