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
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from tests.numerics import cosine
from tests.zoo.families import build
from tests.zoo.lifecycle import INT8

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["ConvNeXt", "ConvNeXtV2"])
def test_every_conv_runs_in_integers(tmp_path, family):
    model, inputs = build(family)
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    cfg, rec = str(tmp_path / "q.cfg"), str(tmp_path / "rec.txt")
    with open(cfg, "w") as f:
        f.write(INT8)
    c = amct.create_compressed_retrain_model(model, inputs, cfg, rec)
    c.train()
    with torch.no_grad():
        c(**inputs)  # initialise the clips
    c.eval()
    amct.save_compressed_retrain_model(c, rec, str(tmp_path / "m"), inputs)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    so.log_severity_level = 3  # the "hardware specific optimizations" warning: we only read the graph
    deploy = ort.InferenceSession(str(tmp_path / "m_deploy_model.onnx"), so, providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
    assert ops["Conv"] == 0, dict(ops)
    assert ops["QLinearConv"] + ops["ConvInteger"] == convs, dict(ops)
    # and it still computes what the fake-quant model computes
    fake = ort.InferenceSession(str(tmp_path / "m_fake_quant_model.onnx"), providers=["CPUExecutionProvider"])
    feed = {i.name: v.numpy() for i, v in zip(deploy.get_inputs(), inputs.values())}
    y_dep, y_fake = deploy.run(None, feed)[0], fake.run(None, feed)[0]
    assert np.isfinite(y_dep).all()
    assert cosine(y_dep, y_fake) >= 0.999
