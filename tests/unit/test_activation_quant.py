"""The activation_quant technique quantizes SiLU / Sigmoid (and the squeeze-excitation
multiply after them) in the training model, so the deploy model keeps those tensors in int8
and the fake-quant model computes the same grid values."""

import collections

import numpy as np
import onnxruntime as ort
import pytest
import torch

import openamct as amct
from openamct.quant.activation import QuantizedActivation
from openamct.quant.residual import output_hooks
from openamct.record.file_io import read_record, write_record
from openamct.techniques.activation_quant import ALGORITHM
from openamct.techniques.base import selective_algorithm
from tests.numerics import assert_same_quantized_function
from tests.runtimes import ort_optimized_ops
from tests.se_model import SENet
from tests.training import checkpoint_and_save

CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
"""


def _model():
    torch.manual_seed(0)
    return SENet().eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("aq")
    cfg, rec = str(d / "q.cfg"), str(d / "rec.txt")
    with open(cfg, "w") as f:
        f.write(CFG)
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    original = _model()
    before = {k: v.clone() for k, v in original.state_dict().items()}
    c = amct.create_compressed_retrain_model(original, x, cfg, rec)
    assert all(torch.equal(before[k], v) for k, v in original.state_dict().items())  # caller's model untouched
    assert not any(isinstance(m, QuantizedActivation) for m in original.modules())
    c.train()
    opt = torch.optim.SGD(c.parameters(), lr=1e-3)
    for _ in range(3):
        loss = c(torch.randn(8, 1, 28, 28)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    ref, ckpt = checkpoint_and_save(c, d, x, rec)
    return {"dir": d, "cfg": cfg, "rec": rec, "ckpt": ckpt, "x": x, "ref": ref, "model": c}


def test_structure_follows_the_readers(saved):
    wrappers = {n: m for n, m in saved["model"].named_modules() if isinstance(m, QuantizedActivation)}
    # every SiLU and Sigmoid of the model sits right after a quantized conv (+ folded BN)
    assert len(wrappers) == 1 + 3 * 4
    quantizers = {n: sorted(w.quantizers()) for n, w in wrappers.items()}
    # read by a conv (through the TF-style zero pad): that conv's input quantizer is its output Q
    assert quantizers["stem_act"] == ["q_in", "q_inner"]
    assert quantizers["blocks.0.expand_act"] == ["q_in", "q_inner"]
    assert quantizers["blocks.0.se.act_reduce"] == ["q_in", "q_inner"]
    # read by the SE pool and the multiply, no layer: quantized here
    assert quantizers["blocks.0.dw_act"] == ["q_in", "q_inner", "q_out"]
    assert quantizers["blocks.0.se.act_expand"] == ["q_in", "q_out"]
    for w in wrappers.values():
        assert all(bool(q.initialized) for q in w.quantizers().values())
    # conv outputs only int8 ops read: the residual Add (blocks.1) and the classifier's pool
    # (blocks.2); blocks.0's feeds blocks.1's expand conv and its residual Add: quantized too,
    # so the Add reads in fake-quant what QLinearAdd reads in deploy
    with_output = sorted(n for n, m in saved["model"].named_modules() if getattr(m, "out_quant", None) is not None)
    assert with_output == ["blocks.0.project", "blocks.1.project", "blocks.2.project"]


def test_deploy_runs_them_in_int8(saved):
    d = saved["dir"]
    ops = collections.Counter(ort_optimized_ops(d / "m_deploy_model.onnx", d))
    assert ops["QLinearSigmoid"] == 13 and ops["QLinearMul"] == 13, ops
    assert ops["QLinearGlobalAveragePool"] >= 3, ops  # the SE squeezes read a quantized tensor
    # the TF-style zero pads went into the depthwise convs' own padding (QLinearConv pads with 0)
    for float_op in ("Sigmoid", "Mul", "GlobalAveragePool", "Pad"):
        assert ops[float_op] == 0, ops


def _ort(path, x):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x.numpy()})[0]


def test_fake_quant_reproduces_torch(saved):
    fake = _ort(str(saved["dir"] / "m_fake_quant_model.onnx"), saved["x"])
    assert_same_quantized_function(saved["ref"], fake, what="fake-quant vs torch")


def test_restore_replays_them(saved):
    r = amct.restore_compressed_retrain_model(_model(), saved["x"], saved["cfg"], saved["rec"], saved["ckpt"],
                                              "state_dict")
    r.eval()
    with torch.no_grad():
        assert np.array_equal(r(saved["x"]).numpy(), saved["ref"])
    entries = [pr.selective_prune for pr in read_record(saved["rec"]).prune_record
               if selective_algorithm(pr) == ALGORITHM]
    wrapped = [n for n, m in r.named_modules() if isinstance(m, QuantizedActivation)]
    with_output = [n for n, m in r.named_modules() if getattr(m, "out_quant", None) is not None]
    hooked = [n for n, _ in output_hooks(r)]
    assert sorted(e.name for e in entries) == sorted(wrapped + with_output + hooked)


def test_restore_refuses_a_record_naming_another_module(saved, tmp_path):
    record = read_record(saved["rec"])
    entry = next(pr for pr in record.prune_record if selective_algorithm(pr) == ALGORITHM)
    entry.selective_prune.name = "blocks.9.not_there"
    bad = str(tmp_path / "bad.txt")
    with open(saved["rec"], encoding="utf-8") as f:
        header = "".join(line for line in f if line.startswith("#"))
    write_record(bad, record, header)
    with pytest.raises(ValueError, match="blocks.9.not_there"):
        amct.restore_compressed_retrain_model(_model(), saved["x"], saved["cfg"], bad, saved["ckpt"], "state_dict")


def test_wrapper_checks_its_arguments():
    with pytest.raises(ValueError, match="kind"):
        QuantizedActivation("gelu", torch.nn.Identity())
    with pytest.raises(ValueError, match="q_inner"):
        QuantizedActivation("silu", torch.nn.Identity())
