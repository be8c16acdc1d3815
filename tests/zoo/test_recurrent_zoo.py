"""Recurrent models (recurrent_families.py) x the three configs through the whole lifecycle
(lifecycle.run): create, a few SGD steps, checkpoint, exact restore, save, both ONNX files in
ONNX Runtime and the deploy file in OpenVINO. The recurrent layer is quantized in every config (its record
entries checked); 2:4 and filter pruning reach the MLP heads only (pruning groups end at an
LSTM/GRU)."""

import pytest

from tests.zoo.lifecycle import CONFIGS, run
from tests.zoo.recurrent_families import build
from tests.zoo.vision import check, one_thread

pytestmark = pytest.mark.slow


CASES = [("ConvGRU", c) for c in CONFIGS] + [("SeriesLSTM", "int8")]


@pytest.mark.parametrize(("family", "config"), CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_recurrent_zoo(tmp_path, family, config):
    with one_thread():
        r = run(lambda: build(family), CONFIGS[config], str(tmp_path))
    check(r, config)
    record = (tmp_path / "record.txt").read_text()
    assert "scale_h:" in record and "scale_r:" in record  # the recurrent layer's entries
    assert r["deploy_vs_fake"] >= 0.999, r  # only the hidden state's rounding differs in deploy
