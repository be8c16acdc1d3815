"""Activation/weight format pairs as data (``openamct.formats.PAIRS``): which pairs each layer
type takes in the .cfg and the JSON config, and upstream's refusals, each naming the field and
the layer."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import openamct as amct
from openamct import pipeline
from openamct.config.errors import ConfigError
from openamct.formats import (
    INT4_WEIGHT,
    INT8_ACT,
    INT8_WEIGHT,
    INT16_ACT,
    PAIRS,
    format_pair,
    pair_name,
)


class ConvSeq(nn.Module):
    """``conv`` (Conv1d) -> ``rnn`` (LSTM) -> ``fc``: one layer of each family."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, padding=1)
        self.rnn = nn.LSTM(6, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.rnn(self.conv(x).transpose(1, 2))
        return self.fc(y[:, -1])


X = torch.randn(2, 4, 5)


def _cfg(tmp_path, act="INT8", wts="INT8", extra=""):
    p = tmp_path / "q.cfg"
    p.write_text(f"retrain_data_quant_config {{ ulq_quantize {{ dst_type: {act} }} }}\n"
                 f"retrain_weight_quant_config {{ arq_retrain {{ dst_type: {wts} }} }}\n" + extra)
    return str(p)


def _plan(cfg):
    plan = pipeline.analyse(ConvSeq(), X, cfg, "compressed").plan
    return {n: lp.quant for n, lp in plan.layers.items() if lp.quant is not None}


def test_the_pair_table():
    assert set(PAIRS) == {"A8W8", "A8W4", "A16W8"}
    assert (PAIRS["A8W4"].act, PAIRS["A8W4"].weight) == (INT8_ACT, INT4_WEIGHT)
    assert (PAIRS["A16W8"].act, PAIRS["A16W8"].weight) == (INT16_ACT, INT8_WEIGHT)
    assert pair_name("INT16", "INT8") == "A16W8"
    for t in ("Conv1d", "Conv2d", "ConvTranspose1d", "ConvTranspose2d", "Linear", "LSTM", "GRU"):
        assert format_pair("INT8", "INT4", t, "x").name == "A8W4"
    assert format_pair("INT16", "INT8", "GRU", "x").name == "A16W8"
    assert format_pair("INT16", "INT8", "Conv2d", "x", single_op=True).name == "A16W8"
    with pytest.raises(ValueError, match=r"where: A16W8 .* GRU, LSTM only, not on Conv2d"):
        format_pair("INT16", "INT8", "Conv2d", "where")
    for act, wts in (("INT4", "INT4"), ("INT4", "INT8")):
        with pytest.raises(ValueError, match=r"A4W[48]\) is refused: Int4 quantization aware training is not supported"):
            format_pair(act, wts, "Linear", "where")
    with pytest.raises(ValueError, match=r"A16W4\) is refused.*supported pairs: A8W8, A8W4, A16W8"):
        format_pair("INT16", "INT4", "LSTM", "where")


def test_a8w4_global_and_per_layer(tmp_path):
    specs = _plan(_cfg(tmp_path, wts="INT4"))
    assert set(specs) == {"conv", "rnn", "fc"}
    assert all(s.wts.format.bits == 4 and s.act.format == INT8_ACT for s in specs.values())
    per_layer = ('override_layer_configs { layer_name: "rnn" retrain_data_quant_config { ulq_quantize { } } '
                 'retrain_weight_quant_config { arq_retrain { dst_type: INT4 } } }\n')
    specs = _plan(_cfg(tmp_path, extra=per_layer))
    assert {n: s.wts.dst_type for n, s in specs.items()} == {"conv": "INT8", "rnn": "INT4", "fc": "INT8"}


def test_a16w8_on_the_recurrent_layers_only(tmp_path):
    by_type = ('override_layer_types { layer_type: "LSTM" retrain_data_quant_config { ulq_quantize { dst_type: INT16 } } '
               'retrain_weight_quant_config { arq_retrain { } } }\n')
    specs = _plan(_cfg(tmp_path, extra=by_type))
    assert specs["rnn"].act.format == INT16_ACT and specs["conv"].act.format == INT8_ACT
    with pytest.raises(ConfigError, match=r"layer 'conv' \(Conv1d\): retrain_data_quant_config.ulq_quantize.dst_type "
                                          r"INT16 / .*A16W8 .* on GRU, LSTM only, not on Conv1d"):
        _plan(_cfg(tmp_path, act="INT16"))
    with pytest.raises(ConfigError, match=r"layer 'rnn' \(LSTM\).*A16W4\) is refused"):
        _plan(_cfg(tmp_path, act="INT16", wts="INT4", extra='quant_skip_layers: "conv"\nquant_skip_layers: "fc"\n'))


@pytest.mark.parametrize("wts", ["INT4", "INT8"])
def test_int4_activations_refused_with_upstreams_reason(tmp_path, wts):
    with pytest.raises(ConfigError, match=r"line 1:\d+.*ulq_quantize.dst_type: INT4 is for weights only.*"
                                          r"Int4 quantization aware training is not supported"):
        _plan(_cfg(tmp_path, act="INT4", wts=wts))


def test_the_qat_json_takes_the_pairs(tmp_path):
    cfg = str(tmp_path / "q.json")
    amct.create_quant_retrain_config(cfg, ConvSeq(), X)
    data = json.loads(open(cfg).read())
    data["conv"]["retrain_weight_config"]["dst_type"] = "INT4"
    data["rnn"]["retrain_data_config"]["dst_type"] = "INT16"
    open(cfg, "w").write(json.dumps(data))
    m = amct.create_quant_retrain_model(cfg, ConvSeq(), str(tmp_path / "r.txt"), X)
    assert m.conv.wts_quant.format.bits == 4 and m.rnn.act_quant.format == INT16_ACT
    assert all(q.format == INT16_ACT for q in m.rnn.h_quant.values())
    data["fc"]["retrain_data_config"]["dst_type"] = "INT16"
    open(cfg, "w").write(json.dumps(data))
    with pytest.raises(ConfigError, match=r"layer 'fc' \(Linear\): retrain_data_config.dst_type INT16 .*not on Linear"):
        amct.create_quant_retrain_model(cfg, ConvSeq(), str(tmp_path / "r.txt"), X)
    data["fc"]["retrain_data_config"]["dst_type"] = "INT4"
    open(cfg, "w").write(json.dumps(data))
    with pytest.raises(ConfigError, match=r"layer 'fc'.*A4W8\) is refused: Int4 quantization aware training"):
        amct.create_quant_retrain_model(cfg, ConvSeq(), str(tmp_path / "r.txt"), X)
    data["fc"]["retrain_data_config"]["dst_type"] = "INT3"
    open(cfg, "w").write(json.dumps(data))
    with pytest.raises(ConfigError, match=r"layer 'fc'.retrain_data_config.dst_type: 'INT3' is not a format"):
        amct.create_quant_retrain_model(cfg, ConvSeq(), str(tmp_path / "r.txt"), X)
