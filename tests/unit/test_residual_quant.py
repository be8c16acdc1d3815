"""A tensor that a quantized layer and a residual Add both read (a block's output, a
ReLU's) is quantized in the training model with that layer's input quantizer, through a forward
hook on the module that returns it. The deploy model's QLinearAdd reads that grid; without the
hook both files add the unrounded tensor, and the Adds run in float."""

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.compressed.layer import CompressedLayer
from openamct.quant.residual import output_hooks
from openamct.record.file_io import read_record
from openamct.techniques import activation_quant
from openamct.techniques.activation_quant import ALGORITHM
from openamct.techniques.base import selective_algorithm
from tests.numerics import assert_same_quantized_function
from tests.runtimes import ort_run
from tests.training import checkpoint_and_save

CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
"""


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn(self.conv(x))


class ResNetLike(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.act = nn.ReLU()
        self.blocks = nn.Sequential(Block(c), Block(c), Block(c))
        self.head = nn.Conv2d(c, 4, 1, bias=False)

    def forward(self, x):
        return self.head(self.blocks(self.act(self.stem(x))))


def _model():
    torch.manual_seed(0)
    m = ResNetLike()
    with torch.no_grad():
        for b in m.modules():
            if isinstance(b, nn.BatchNorm2d):
                b.weight.uniform_(1.0, 2.0)  # a residual stream that grows: the clips matter
    # No biases (BN's beta and mean stay 0): the deploy file's int32 biases are then exact, and
    # deploy vs fake-quant differ by float noise alone, unless a quantizer differs.
    return m.eval()


def _lifecycle(d, x):
    cfg, rec = str(d / "q.cfg"), str(d / "rec.txt")
    with open(cfg, "w") as f:
        f.write(CFG)
    original = _model()
    c = amct.create_compressed_retrain_model(original, x, cfg, rec)
    assert not output_hooks(original) and not original.act._forward_hooks  # caller's model untouched
    c.train()
    with torch.no_grad():
        c(x)  # clips from this batch
    ref, ckpt = checkpoint_and_save(c, d, x, rec)
    return {"c": c, "dir": d, "cfg": cfg, "rec": rec, "ckpt": ckpt, "ref": ref}


@pytest.fixture(scope="module")
def x():
    return torch.randn(8, 1, 12, 12, generator=torch.Generator().manual_seed(1)) ** 3  # heavy tails: clipped


@pytest.fixture(scope="module")
def saved(tmp_path_factory, x):
    return _lifecycle(tmp_path_factory.mktemp("rq"), x)


def test_block_outputs_read_by_a_layer_and_an_add_are_hooked(saved):
    c = saved["c"]
    assert sorted(n for n, _ in output_hooks(c)) == ["act", "blocks.0", "blocks.1"]
    on_grid = sorted(n for n, m in c.named_modules() if isinstance(m, CompressedLayer) and m.input_on_grid)
    assert on_grid == ["blocks.0.conv", "blocks.1.conv", "blocks.2.conv"]
    hooks = dict(output_hooks(c))
    assert hooks["blocks.0"].quantizer is c.blocks[1].conv.act_quant  # the reader's own quantizer
    entries = {pr.selective_prune.name: pr.selective_prune for pr in read_record(saved["rec"]).prune_record
               if selective_algorithm(pr) == ALGORITHM}
    assert {n for n, e in entries.items() if any(a.s == b"residual" for a in e.attr)} == {"act", "blocks.0", "blocks.1"}


def test_the_three_models_compute_one_function(saved, x):
    d = saved["dir"]
    fake = ort_run(str(d / "m_fake_quant_model.onnx"), x, optimised=True)
    assert_same_quantized_function(saved["ref"], fake, what="fake-quant vs torch")
    # all fusions off: the deploy file's own arithmetic, float kernels between its Q/DQ
    deploy = ort_run(str(d / "m_deploy_model.onnx"), x, optimised=False)
    assert_same_quantized_function(fake, deploy, what="deploy vs fake-quant")
    nodes = onnx.load(str(d / "m_deploy_model.onnx")).graph.node
    made_by = {o: n.op_type for n in nodes for o in n.output}
    # the hooked tensors are quantized once: no Q re-quantizes a DQ's output
    assert not [n.name for n in nodes if n.op_type == "QuantizeLinear" and made_by.get(n.input[0]) == "DequantizeLinear"]
    # ... and every residual Add reads two quantized tensors (ORT runs QLinearAdd)
    adds = [n for n in nodes if n.op_type == "Add"]
    assert len(adds) == 3 and all(made_by.get(i) == "DequantizeLinear" for n in adds for i in n.input)


def test_without_the_hooks_the_adds_stay_float_in_both_files(tmp_path, x, monkeypatch):
    """What the hooks buy: without them the deploy file still computes the training function,
    its Adds reading the tensors unrounded (no QLinearAdd)."""
    plan = activation_quant.ActivationQuant.plan

    def no_residual(self, ctx):
        state = plan(self, ctx)
        state.residual = {}
        return state

    monkeypatch.setattr(activation_quant.ActivationQuant, "plan", no_residual)
    _lifecycle(tmp_path, x)
    fake = ort_run(str(tmp_path / "m_fake_quant_model.onnx"), x, optimised=True)
    deploy = ort_run(str(tmp_path / "m_deploy_model.onnx"), x, optimised=False)
    assert_same_quantized_function(fake, deploy, what="deploy vs fake-quant")
    nodes = onnx.load(str(tmp_path / "m_deploy_model.onnx")).graph.node
    made_by = {o: n.op_type for n in nodes for o in n.output}
    adds = [n for n in nodes if n.op_type == "Add"]
    assert len(adds) == 3 and not all(made_by.get(i) == "DequantizeLinear" for n in adds for i in n.input)


def test_restore_replays_the_hooks(saved, x):
    r = amct.restore_compressed_retrain_model(_model(), x, saved["cfg"], saved["rec"], saved["ckpt"], "state_dict")
    r.eval()
    assert sorted(n for n, _ in output_hooks(r)) == ["act", "blocks.0", "blocks.1"]
    with torch.no_grad():
        assert np.array_equal(r(x).numpy(), saved["ref"])
