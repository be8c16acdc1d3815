"""Bad configs get a ValueError naming the file, the line:column, the field and the layer."""

import pytest
import torch

from openamct import pipeline
from tests.models import Net001


def analyse(tmp_path, text, api="compressed"):
    p = tmp_path / "bad.cfg"
    p.write_text(text)
    return pipeline.analyse(Net001(), torch.randn(1, 2, 28, 28), str(p), api)


def test_syntax_error_has_line_and_column(tmp_path):
    with pytest.raises(ValueError, match=r"bad.cfg'.*line 2:\d+"):
        analyse(tmp_path, "prune_config {\n  filter_pruner { balanced_l2_norm_filter_prune { prune_ratio 0.3 } \n")


def test_unknown_field_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"line 1:\d+.*prune_ration"):
        analyse(tmp_path, "prune_ration: 0.3\n")


@pytest.mark.parametrize("ratio", ["0", "1", "1.5", "-0.2", "nan"])
def test_prune_ratio_outside_open_interval(tmp_path, ratio):
    text = "prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: %s } } }" % ratio
    with pytest.raises(ValueError, match=r"prune_ratio must be in \(0, 1\)"):
        analyse(tmp_path, text)


def test_clip_values_checked(tmp_path):
    text = "retrain_data_quant_config { ulq_quantize { clip_max_min { clip_max: -1 clip_min: -2 } } }"
    with pytest.raises(ValueError, match=r"line 1:\d+: global: clip_max must be a finite number > 0"):
        analyse(tmp_path, text)
    text = "retrain_data_quant_config { ulq_quantize { clip_max_min { clip_max: 1 clip_min: 0.5 } } }"
    with pytest.raises(ValueError, match="clip_min must be a finite number < 0"):
        analyse(tmp_path, text)


def test_unknown_skip_layer_and_type(tmp_path):
    base = "retrain_weight_quant_config { arq_retrain { } }\n"
    with pytest.raises(ValueError, match=r"skip_layers: layer 'layer9.0' does not exist"):
        analyse(tmp_path, base + 'skip_layers: "layer9.0"')
    with pytest.raises(ValueError, match=r"quant_skip_types: 'BatchNorm2d' is not a supported layer type"):
        analyse(tmp_path, base + 'quant_skip_types: "BatchNorm2d"')
    with pytest.raises(ValueError, match=r"layer 'layer1.1' is a BatchNorm2d, not a supported layer"):
        analyse(tmp_path, base + 'skip_layers: "layer1.1"')


def test_empty_config(tmp_path):
    with pytest.raises(ValueError, match="nothing to do"):
        analyse(tmp_path, "")


def test_int4_is_for_weights_only(tmp_path):
    with pytest.raises(ValueError, match=r"line 1:\d+: global.retrain_data_quant_config.ulq_quantize.dst_type: "
                                         "INT4 is for weights only"):
        analyse(tmp_path, "retrain_data_quant_config { ulq_quantize { dst_type: INT4 } }")
    plan = analyse(tmp_path, "retrain_weight_quant_config { arq_retrain { dst_type: INT4 } }").plan
    assert {lp.quant.wts.dst_type for lp in plan.quantized()} == {"INT4"}


def test_duplicate_override_blocks(tmp_path):
    text = ('override_layer_configs { layer_name: "fc.0" retrain_weight_quant_config { arq_retrain {} } }\n'
            'override_layer_configs { layer_name: "fc.0" retrain_weight_quant_config { arq_retrain {} } }\n')
    with pytest.raises(ValueError, match="overridden twice"):
        analyse(tmp_path, text)


def test_not_utf8(tmp_path):
    p = tmp_path / "bad.cfg"
    p.write_bytes(b"prune_config { \xff\xfe }")
    with pytest.raises(ValueError, match="not UTF-8"):
        pipeline.analyse(Net001(), torch.randn(1, 2, 28, 28), str(p), "compressed")


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        pipeline.analyse(Net001(), torch.randn(1, 2, 28, 28), str(tmp_path / "nope.cfg"), "compressed")
