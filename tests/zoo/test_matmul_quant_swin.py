"""torchvision Swin (the zoo's small instance) with ``quantize_activation_matmul: true``: the whole
lifecycle (lifecycle.run: create, SGD steps, exact restore, save, ORT and OpenVINO), and each
window attention's q @ k^T and softmax @ v, and its qkv / proj Linears (called as F.linear by
torchvision), run as integer kernels in ORT's optimised deploy graph, no float MatMul or Gemm left."""

import collections

import pytest

from tests.runtimes import ort_optimized_ops
from tests.zoo.lifecycle import CONFIGS, run
from tests.zoo.vision import check, one_thread

pytestmark = pytest.mark.slow

from tests.zoo.torchvision_families import build  # noqa: E402  (skips without torchvision)


def test_swin_attention_matmuls_in_int8(tmp_path):
    with one_thread():
        r = run(lambda: build("Swin"), CONFIGS["int8"] + "quantize_activation_matmul: true\n", str(tmp_path))
    check(r, "int8")
    assert r["deploy_vs_fake"] >= 0.99, r
    ops = collections.Counter(ort_optimized_ops(tmp_path / "m_deploy_model.onnx", tmp_path))
    blocks = 2  # depths [1, 1]
    # the products: MatMulIntegerToFloat where a float op reads them, else QLinearMatMul
    assert ops["MatMulIntegerToFloat"] + ops["QLinearMatMul"] >= 2 * blocks, ops
    assert ops["MatMul"] + ops["FusedMatMul"] == 0, ops
    # torchvision computes qkv / proj as F.linear(x, qkv.weight, qkv.bias): routed to their
    # compressed layers (compressed/functional.py), they run as int8 kernels too, no float Gemm
    assert ops["Gemm"] == 0, ops
