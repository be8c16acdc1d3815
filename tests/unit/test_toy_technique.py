"""A fourth technique written as one module (tests/techniques/zero_smallest.py) and added to
the registry with one line goes through create -> train -> restore -> save like the built-in
three, with no change anywhere else (docs/dev/ARCHITECTURE.md, "Adding a technique")."""

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from openamct import pipeline
from openamct.compressed.layer import CompressedLayer
from openamct.demo.models import MnistNet
from openamct.record.file_io import read_record
from openamct.techniques import TECHNIQUES
from tests.techniques.zero_smallest import ZeroSmallest
from tests.training import sgd_steps

DEMO_CFG = os.path.join(os.path.dirname(pipeline.__file__), "demo", "demo.cfg")
WITH_TOY = (*TECHNIQUES, ZeroSmallest())  # the registry line


def _model():
    torch.manual_seed(0)
    return MnistNet()


def test_toy_technique_create_restore_save(tmp_path):
    x = torch.randn(8, 1, 28, 28)
    rec, ckpt = str(tmp_path / "record.txt"), str(tmp_path / "ckpt.pth")
    model = pipeline.create(_model(), x, DEMO_CFG, rec, "compressed", techniques=WITH_TOY)

    toy = ZeroSmallest()
    owned = [pr.selective_prune.name for pr in read_record(rec).prune_record if toy.owns(pr)]
    compressed = [n for n, m in model.named_modules() if isinstance(m, CompressedLayer)]
    assert owned and sorted(owned) == sorted(compressed)

    sgd_steps(model, x, steps=3)
    model.eval()
    with torch.no_grad():
        out = model(x)
    for name in owned:
        layer = model.get_submodule(name)
        zeroed = layer.zero_smallest.mask == 0
        assert int(zeroed.sum()) == max(1, layer.weight.numel() // 100), name
        w, _ = layer.effective_weight_bias()
        assert torch.all(w[zeroed] == 0), name  # trained weights stay zero where the toy said
    torch.save({"state_dict": model.state_dict()}, ckpt)

    restored = pipeline.restore(_model(), x, DEMO_CFG, rec, ckpt, "state_dict", "compressed",
                                techniques=WITH_TOY)
    restored.eval()
    with torch.no_grad():
        assert torch.equal(restored(x), out)

    prefix = str(tmp_path / "toy")
    pipeline.save(restored, prefix, x, rec, None, None, None)
    graph = onnx.load(prefix + "_fake_quant_model.onnx").graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    # "/layer2/layer2.0/Conv" -> "layer2.0": the exporter may rename a folded weight, not the node
    weights = {n.name.split("/")[-2]: inits[n.input[1]] for n in graph.node if n.op_type in ("Conv", "Gemm")}
    assert set(owned) <= set(weights)
    for name in owned:
        mask = restored.get_submodule(name).zero_smallest.mask.numpy()
        assert np.all(weights[name][mask == 0] == 0), name


def test_toy_record_without_the_toy_is_refused(tmp_path):
    x = torch.randn(2, 1, 28, 28)
    rec, ckpt = str(tmp_path / "record.txt"), str(tmp_path / "ckpt.pth")
    model = pipeline.create(_model(), x, DEMO_CFG, rec, "compressed", techniques=WITH_TOY)
    torch.save(model.state_dict(), ckpt)
    with pytest.raises(ValueError, match=r"prune_record\[\d+\].*no technique"):
        pipeline.restore(_model(), x, DEMO_CFG, rec, ckpt, None, "compressed")
