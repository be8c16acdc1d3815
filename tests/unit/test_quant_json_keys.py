"""The QAT JSON config refuses what it would otherwise ignore: an unknown key inside a layer
entry and a key given twice, each named with its line."""

from __future__ import annotations

import json

import pytest
import torch

import openamct as amct
from tests.small import ConvFc

X = torch.randn(2, 3, 8, 8)


def _written(tmp_path) -> tuple[str, str]:
    path = str(tmp_path / "q.json")
    amct.create_quant_retrain_config(path, ConvFc(), X)
    with open(path, encoding="utf-8") as f:
        return path, f.read()


def _create(tmp_path, path):
    return amct.create_quant_retrain_model(path, ConvFc(), str(tmp_path / "r.txt"), X)


def test_the_written_config_is_accepted(tmp_path):
    path, _ = _written(tmp_path)
    m = _create(tmp_path, path)
    assert m.conv.act_quant is not None and m.fc.wts_quant is not None


@pytest.mark.parametrize("block", ["", "retrain_data_config", "retrain_weight_config"])
def test_unknown_key_in_a_layer_entry_is_refused_with_its_line(tmp_path, block):
    path, text = _written(tmp_path)
    data = json.loads(text)
    target = data["fc"] if not block else data["fc"][block]
    target["typo_field"] = 1
    new = json.dumps(data, indent=2)
    (tmp_path / "q.json").write_text(new)
    line = next(i for i, s in enumerate(new.splitlines(), 1) if '"typo_field"' in s)
    where = "layer 'fc'" + (f".{block}" if block else "")
    with pytest.raises(ValueError, match=rf"line {line}: {where}: unknown key 'typo_field'"):
        _create(tmp_path, path)
    assert not (tmp_path / "r.txt").exists()


def test_a_layer_given_twice_is_refused_with_the_second_line(tmp_path):
    path, text = _written(tmp_path)
    lines = text.rstrip().splitlines()
    fc_at = next(i for i, s in enumerate(lines) if s.startswith('  "fc"'))
    entry = lines[fc_at:-1]  # the fc block up to the closing brace of the document
    entry[-1] = entry[-1] + ","  # the old last entry now has a follower
    dup = [s.replace("false", "true") for s in entry]
    dup[-1] = dup[-1].rstrip(",")
    new = "\n".join(lines[:fc_at] + entry + dup + ["}"]) + "\n"
    json.loads(new)  # valid JSON: only the duplicate is wrong
    (tmp_path / "q.json").write_text(new)
    second = fc_at + len(entry) + 1
    with pytest.raises(ValueError, match=rf"line {second}: key 'fc' is given twice"):
        _create(tmp_path, path)
