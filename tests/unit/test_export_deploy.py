"""Deploy ONNX: INT8 storage, integer kernels in ONNX Runtime, agreement with the fake-quant model.

Models are trained on real data (sklearn's 8x8 digits) in FP32, then QAT-trained a few steps, so
clips and output observers hold realistic ranges; agreement is measured on 64 test digits.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import openamct as amct
from examples.digits import load_digits
from openamct.export.int8_kernels import u8s8_saturates
from openamct.export.verify import format_verification, verify_pair
from tests.models import MobileNetV2Tiny, ResBlockNet, TinyTransformerBlock
from tests.numerics import (
    assert_logits_agree,
    assert_same_quantized_function,
    skip_unless_exact_int8_kernels,
)

QUANT_CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
"""


class Upsampled(nn.Module):
    """Digits (1x8x8) resized and repeated to the wrapped CNN's input layout."""

    def __init__(self, inner: nn.Module, size: int, channels: int) -> None:
        super().__init__()
        self.inner, self.size, self.channels = inner, size, channels

    def forward(self, x):
        x = F.interpolate(x, size=(self.size, self.size), mode="nearest")
        return self.inner(x.expand(-1, self.channels, -1, -1))


class DigitsTransformer(nn.Module):
    """Each digit's 8 rows as 8 tokens: embed -> transformer block -> mean -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.block = TinyTransformerBlock()
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.block(self.embed(x.reshape(x.shape[0], 8, 8))).mean(1))


class PlainChain(nn.Module):
    """No bias, no BN, no add: every Q/DQ the deploy pass moves is exact, so the deploy model
    is the fake-quant model up to QuantizeLinear's x/s vs the fake quant's x*(1/s)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.fc = nn.Linear(16 * 4 * 4, 10, bias=False)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        return self.fc(torch.flatten(torch.relu(self.conv2(x)), 1))


MODELS = {
    "ResBlockNet": lambda: Upsampled(ResBlockNet(), 8, 3),
    "MobileNetV2Tiny": lambda: Upsampled(MobileNetV2Tiny(), 8, 3),
    "DigitsTransformer": DigitsTransformer,
    "PlainChain": PlainChain,
}
LINEARS = {"DigitsTransformer": 8}  # embed, q, k, v, out, fc1, fc2, head
# Bound on max |deploy - fake-quant| / logit range (test_deploy_agrees_with_fake_quant_on_real_digits)
DEPLOY_NOISE = {"ResBlockNet": 0.01, "MobileNetV2Tiny": 0.03, "DigitsTransformer": 0.008, "PlainChain": 0.01}


def _train(model: nn.Module, x, y, steps: int, lr: float) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(x), (64,), generator=g)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def digits():
    d = load_digits()
    return tuple(torch.as_tensor(v) for v in (d.x_train, d.y_train, d.x_test, d.y_test))


@pytest.fixture(scope="module")
def saved(digits, tmp_path_factory):
    """name -> (fake path, deploy path): FP32 training, create, QAT steps, eval, save."""
    # The tiny CNNs hit denormals (steps 10-100x slower), and 1 thread beats 2 for them, most of
    # all on a busy machine.
    torch.set_flush_denormal(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    xtr, ytr, _, _ = digits
    out = {}
    try:
        for name, make in MODELS.items():
            torch.manual_seed(0)
            folder = tmp_path_factory.mktemp(name)
            model = _train(make(), xtr, ytr, 300, 3e-3)
            cfg, rec = str(folder / "q.cfg"), str(folder / "record.txt")
            with open(cfg, "w") as f:
                f.write(QUANT_CFG)
            c = amct.create_compressed_retrain_model(model, xtr[:2], cfg, rec)
            _train(c, xtr, ytr, 15, 1e-4)
            with torch.no_grad():
                c(xtr[:64])
            amct.save_compressed_retrain_model(c, rec, str(folder) + "/", xtr[:1], input_names=["x"],
                                               dynamic_axes={"x": [0]})
            out[name] = (str(folder / "fake_quant_model.onnx"), str(folder / "deploy_model.onnx"))
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    return out


def _session(path: str, level=None, optimized: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if level is not None:
        so.graph_optimization_level = level
    if optimized:
        so.optimized_model_filepath = optimized
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", ["ResBlockNet", "MobileNetV2Tiny", "DigitsTransformer", "PlainChain"])
def test_deploy_agrees_with_fake_quant_on_real_digits(name, saved, digits):
    fake, deploy = saved[name]
    x = digits[2][:64].numpy()
    skip_unless_exact_int8_kernels()
    a, b = _session(fake).run(None, {"x": x})[0], _session(deploy).run(None, {"x": x})[0]
    # Was "cosine >= 0.999 and argmax agreement >= 0.99": the latter holds only while no sample's
    # top-2 margin is as small as the deploy graph's rounding noise, which depends on where
    # training lands on each CPU. Now the noise is bounded per model at ~3x its measured maximum
    # relative to the logit range (6 (seed, thread count) pairs: ResBlockNet 0.0025-0.0031,
    # MobileNetV2Tiny 0.008-0.011, DigitsTransformer 0.0019-0.0026, PlainChain 0; cosine >=
    # 0.99991; >= 94 % of the digits decisive). int32 biases 5 % off give 0.046 / 0.048 / 0.022.
    assert_logits_agree(a, b, max_rel_diff=DEPLOY_NOISE[name], min_decisive=0.75, min_cosine=0.9995, what=name)


@pytest.mark.parametrize("name", ["ResBlockNet", "MobileNetV2Tiny", "DigitsTransformer"])
def test_deploy_stores_int8_weights_int32_biases_uint8_activations(name, saved):
    proto = onnx.load(saved[name][1])
    inits = {t.name: t for t in proto.graph.initializer}
    prod = {o: n for n in proto.graph.node for o in n.output}

    def weight(n):  # the initializer behind input 1, if any (attention matmuls have none)
        p = prod.get(n.input[1])
        return n.input[1] if n.input[1] in inits else p.input[0] if p is not None and p.input[0] in inits else None

    layers = [n for n in proto.graph.node if n.op_type in ("Conv", "Gemm", "MatMul") and weight(n)]
    assert len(layers) == LINEARS.get(name, len(layers)) and layers
    for n in layers:
        w = prod.get(n.input[1])
        assert w is not None and w.op_type == "DequantizeLinear", n.name
        assert inits[w.input[0]].data_type == onnx.TensorProto.INT8, n.name
        x = prod[n.input[0]]
        assert x.op_type == "DequantizeLinear" and inits[x.input[2]].data_type == onnx.TensorProto.UINT8
        if len(n.input) > 2:
            b = prod[n.input[2]]
            assert b.op_type == "DequantizeLinear" and inits[b.input[0]].data_type == onnx.TensorProto.INT32
    assert not any(t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 4 for t in inits.values())


def test_ort_runs_the_deploy_models_in_integer_kernels(saved, tmp_path):
    ops = {}
    for name in ("ResBlockNet", "MobileNetV2Tiny", "DigitsTransformer"):
        opt = str(tmp_path / f"{name}.onnx")
        _session(saved[name][1], optimized=opt)
        ops[name] = Counter(n.op_type for n in onnx.load(opt).graph.node)
    for name in ("ResBlockNet", "MobileNetV2Tiny"):
        c = ops[name]
        assert c["Conv"] == 0 and c["QLinearConv"] >= 4 and c["QLinearAdd"] >= 1, (name, dict(c))
        assert c["QLinearGlobalAveragePool"] == 1 and c["QGemm"] == 1, (name, dict(c))
        assert c["DequantizeLinear"] <= 1, (name, dict(c))  # only where float is needed
    t = ops["DigitsTransformer"]
    assert t["QGemm"] == LINEARS["DigitsTransformer"] and t["MatMulInteger"] + t["MatMul"] <= 2, dict(t)


def test_exactly_placed_quantizers_reproduce_the_fake_quant_model(saved, digits):
    fake, deploy = saved["PlainChain"]
    x = digits[2][:64].numpy()
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the graph's own float semantics
    a, b = _session(fake, level).run(None, {"x": x})[0], _session(deploy, level).run(None, {"x": x})[0]
    ulp = np.spacing(np.float32(np.abs(a).max()))
    # Was "every element within 16 ulps". QuantizeLinear's x / s and the fake quant's x * (1 / s)
    # round to different integers for about 3 in 10^6 values (the last bit at a .5), so on some
    # CPU's trained weights one of the 64 digits may move a quantization step (estimated ~10 %
    # per set of weights). 90 % of the elements (nearly every sample) must still be within 16 ulps,
    # which a misplaced or rescaled Q/DQ fails; the rest within one flip.
    assert_same_quantized_function(a, b, noise_rel=16 * ulp / float(a.max() - a.min()), min_clean=0.9,
                                   what="PlainChain")


def test_verify_pair_reports_agreement_and_latency(saved):
    fake, deploy = saved["ResBlockNet"]
    r = verify_pair(fake, deploy, (8, 1, 8, 8), runs=3, samples=2)
    assert r["files"] == {"deploy": deploy, "fake-quant": fake}
    assert r["inputs"] == {"x": [8, 1, 8, 8]} and r["outputs"][0]["shape"] == [8, 10]
    a = r["agreement"]["fake-quant"]["output"]
    assert a["rows"] == 16 and a["samples"] == 2 and 0 <= a["same_top1"] <= 16
    assert r["latency_ms"]["fake-quant"] > 0 and r["latency_ms"]["deploy"] > 0 and r["speedup_vs_fp32"] is None
    assert r["integer_kernels"].get("QLinearConv", 0) > 0
    text = format_verification(r)
    assert "cosine" in text and "same top-1" in text and "speed-up over FP32: not measured" in text
    # Where ORT's u8s8 kernels saturate (x86-64 without VNNI) the report says so, and the
    # agreement is ORT's, not the file's (measured cosine 0.94 here on an AVX2-only EPYC).
    assert r["u8s8_saturates"] == u8s8_saturates() and ("without VNNI" in text) == r["u8s8_saturates"]
    if not r["u8s8_saturates"]:
        assert a["cosine_mean"] > 0.99
    assert verify_pair(fake, deploy, (1, 1, 8, 8), batch=5, runs=1, samples=1)["inputs"]["x"] == [5, 1, 8, 8]


def test_verify_pair_rejects_bad_input(saved, tmp_path):
    fake, deploy = saved["ResBlockNet"]
    with pytest.raises(ValueError, match="deploy_path"):
        verify_pair(fake, str(tmp_path / "missing.onnx"), (1, 1, 8, 8))
    with pytest.raises(ValueError, match="input_shape"):
        verify_pair(fake, deploy, (1, -1, 8, 8))
    with pytest.raises(ValueError, match="input-shape"):
        verify_pair(fake, deploy, (1, 3, 8, 8))
    with pytest.raises(ValueError, match="wrong way round"):
        verify_pair(deploy, fake, (1, 1, 8, 8))
