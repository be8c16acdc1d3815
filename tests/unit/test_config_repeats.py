"""A singular field or a oneof given twice is an error naming the field and
the line; upstream's sample configs (one layer_name written twice) still parse."""

from __future__ import annotations

import glob

import pytest

from openamct.config.parse import ConfigError, parse_config_text
from tests.conftest import COMPAT

NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { } } }\n"
FP = "prune_config {\n  filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 } }\n}\n"


@pytest.mark.parametrize("text,msg", [
    (NM + FP, r"line 2:1: field 'prune_config' is given twice in AMCTRetrainConfig \(first at line 1\)"),
    ("batch_num: 1\nbatch_num: 2\n", r"line 2:1: field 'batch_num' is given twice"),
    ("override_layer_configs {\n layer_name: 'a'\n layer_name: 'b'\n}\n",
     r"line 3:2: field 'layer_name' is given twice in RetrainOverrideLayer \(first at line 2\)"),
    ("prune_config {\n filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 } }\n"
     " n_out_of_m_pruner { l1_selective_prune { } }\n}\n",
     r"line 3:2: field 'n_out_of_m_pruner' and field 'filter_pruner' \(line 2\) are both given in PruneConfig"),
    ("retrain_weight_quant_config { arq_retrain { } ulq_retrain { } }\n",
     r"line 1:47: field 'ulq_retrain' and field 'arq_retrain' \(line 1\) are both given in "
     r"RetrainWeightQuantConfig, but only one of them may be \(they are alternatives of 'wts_algo'\)"),
    ("retrain_data_quant_config { ulq_quantize { clip_max_min { clip_max: 1 clip_min: -1 clip_max: 2 } } }\n",
     r"field 'clip_max' is given twice in ClipMaxMin"),
])
def test_repeated_singular_fields_and_oneofs_are_refused(text, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_config_text(text, "config_defination 'x.cfg'")


def test_same_value_twice_and_repeated_fields_are_fine():
    cfg = parse_config_text("override_layer_configs {\n layer_name: \"a\"\n layer_name: \"a\"\n" + NM + "}\n"
                            "skip_layers: 'x'\nskip_layers: 'x'\nskip_layers: ['y', 'z']\n")
    assert cfg.override_layer_configs[0].layer_name == "a" and list(cfg.skip_layers) == ["x", "x", "y", "z"]


def test_every_upstream_sample_config_still_parses_as_before():
    files = glob.glob(f"{COMPAT}/configs/*.cfg")
    assert len(files) >= 30
    for path in files:
        text = open(path).read()
        try:
            parse_config_text(text, path)
        except ConfigError as exc:
            assert "given twice" not in str(exc) and "both given" not in str(exc), exc
