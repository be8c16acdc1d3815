"""The single-op QAT config parser: upstream's defaults, and every refusal names its key."""

import pytest

from openamct.nn.module.quantization.config import parse_qat_config


def test_defaults_are_upstreams():
    cfg = parse_qat_config(None, "Conv2d")
    assert cfg.retrain_enable and cfg.batch_num == 1
    act, wts = cfg.quant.act, cfg.quant.wts
    assert (act.clip_max, act.clip_min, act.fixed_min, act.dst_type) == (None, None, False, "INT8")
    assert (wts.algo, wts.channel_wise, wts.dst_type) == ("arq", True, "INT8")
    assert parse_qat_config({}, "Linear").quant.wts.channel_wise is False


def test_full_config_is_read():
    cfg = parse_qat_config({"retrain_enable": True,
                            "retrain_data_config": {"dst_type": "INT8", "batch_num": 3, "fixed_min": True,
                                                    "clip_min": -2, "clip_max": 1.5},
                            "retrain_weight_config": {"dst_type": "INT8", "weights_retrain_algo": "ulq_quantize",
                                                      "channel_wise": False}}, "Conv3d")
    assert cfg.batch_num == 3
    assert (cfg.quant.act.clip_max, cfg.quant.act.clip_min, cfg.quant.act.fixed_min) == (1.5, -2.0, True)
    assert (cfg.quant.wts.algo, cfg.quant.wts.channel_wise) == ("ulq", False)
    assert parse_qat_config({"retrain_data_config": {"dst_type": "INT16"}}, "Conv2d").quant.act.dst_type == "INT16"
    off = parse_qat_config({"retrain_enable": False}, "Conv2d")
    assert off.quant is None and not off.retrain_enable


@pytest.mark.parametrize("config, exc, words", [
    ("INT8", TypeError, ["config", "dict"]),
    ({"retrain_enabled": True}, ValueError, ["unknown key 'retrain_enabled'", "retrain_enable"]),
    ({"retrain_data_config": {"clipmax": 1.0}}, ValueError, ["retrain_data_config", "'clipmax'"]),
    ({"retrain_weight_config": {"algo": "arq_retrain"}}, ValueError, ["retrain_weight_config", "'algo'"]),
    ({"retrain_enable": 1}, TypeError, ["retrain_enable", "bool"]),
    ({"retrain_data_config": {"batch_num": True}}, TypeError, ["batch_num", "int"]),
    ({"retrain_data_config": {"batch_num": 0}}, ValueError, ["batch_num", ">= 1"]),
    ({"retrain_data_config": {"fixed_min": "yes"}}, TypeError, ["fixed_min"]),
    ({"retrain_data_config": {"clip_max": 1.0}}, ValueError, ["clip_min is missing"]),
    ({"retrain_data_config": {"clip_max": -1.0, "clip_min": -2.0}}, ValueError, ["clip_max", "> 0"]),
    ({"retrain_data_config": {"clip_max": 1.0, "clip_min": float("nan")}}, ValueError, ["clip_min"]),
    ({"retrain_data_config": {"clip_max": "1", "clip_min": -1.0}}, TypeError, ["clip_max", "number"]),
    ({"retrain_data_config": "x"}, TypeError, ["retrain_data_config", "dict"]),
    ({"retrain_weight_config": {"weights_retrain_algo": "lsq"}}, ValueError, ["weights_retrain_algo", "'lsq'"]),
    ({"retrain_weight_config": {"channel_wise": 1}}, TypeError, ["channel_wise", "bool"]),
    ({"retrain_data_config": {"dst_type": "INT16"}, "retrain_weight_config": {"dst_type": "INT4"}}, ValueError,
     ["retrain_weight_config.dst_type", "A16W4", "refused"]),
    ({"retrain_data_config": {"dst_type": "INT4"}}, ValueError, ["retrain_data_config.dst_type", "weight format",
                                                                 "Int4 quantization aware training is not supported"]),
    ({"retrain_data_config": {"dst_type": "FP8"}}, ValueError, ["dst_type", "'FP8'"]),
    # a typo is refused even when the layer is not quantized
    ({"retrain_enable": False, "retrain_weight_config": {"chanel_wise": True}}, ValueError, ["'chanel_wise'"]),
])
def test_refusals_name_the_key(config, exc, words):
    with pytest.raises(exc) as info:
        parse_qat_config(config, "Conv2d")
    for w in words:
        assert w in str(info.value)
