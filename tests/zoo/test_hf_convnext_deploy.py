"""Hugging Face ConvNeXt's deploy file runs every conv in integers in ONNX Runtime.

Its depthwise convs and patch-embedding conv are read by ``ConvNextLayerNorm`` (a subclass of
``nn.LayerNorm`` that permutes around the norm in its channels-first form). The rule that gives
a conv read only by LayerNorms a trained output quantizer once knew LayerNorm by name only, so
there those convs stayed float Conv kernels in ORT's optimised graph and the deploy file ran at
the FP32 model's speed. Structural, so exact on every CPU: the optimised graph depends on the
ORT version, not on float sums.
"""

import collections

import numpy as np
import onnxruntime as ort
import pytest
from torch import nn

from tests.numerics import cosine
from tests.zoo.families import build
from tests.zoo.lifecycle import int8_deploy_graph

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["ConvNeXt", "ConvNeXtV2"])
def test_every_conv_runs_in_integers(tmp_path, family):
    model, inputs = build(family)
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    ops = collections.Counter(n.op_type for n in int8_deploy_graph(model, inputs, str(tmp_path)).node)
    assert ops["Conv"] == 0, dict(ops)
    assert ops["QLinearConv"] + ops["ConvInteger"] == convs, dict(ops)
    # and it still computes what the fake-quant model computes
    deploy = ort.InferenceSession(str(tmp_path / "m_deploy_model.onnx"), providers=["CPUExecutionProvider"])
    fake = ort.InferenceSession(str(tmp_path / "m_fake_quant_model.onnx"), providers=["CPUExecutionProvider"])
    feed = {i.name: v.numpy() for i, v in zip(deploy.get_inputs(), inputs.values())}
    y_dep, y_fake = deploy.run(None, feed)[0], fake.run(None, feed)[0]
    assert np.isfinite(y_dep).all()
    assert cosine(y_dep, y_fake) >= 0.999
