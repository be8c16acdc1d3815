"""The fused training path of a compressed Linear (large/fused_linear.py): the same
numbers as the composed mask -> ARQ -> F.linear path, and no weight-sized allocation per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from openamct.compressed.layer import CompressedLayer
from openamct.large import fused_linear
from openamct.large.fused_linear import masked_quant_linear
from openamct.large.runtime import LargeRuntime
from openamct.quant.functions import arq_scales, arq_weight_fake_quant
from openamct.quant.quantizers import WeightARQ
from openamct.record.mask_codec import pack_bits
from openamct.sparsity.nm import NMSparsifier, apply_bits, apply_mask, compute_nm_mask, masked_ste

RT = LargeRuntime()  # the buffers these tests' layers and calls share (a model's keeper owns one)


def _names() -> set[str]:
    """The effective-weight buffers in the scratch (not the mask unpack's "index"/"flags")."""
    return {k[0] for k in RT.scratch.tensors} - {"index", "flags"}


def _composed(x, w, b, mask_bits, channel_wise, transposed):
    wm = w if mask_bits is None else masked_ste(w, mask_bits, apply_bits)
    wq = wm if channel_wise is None else arq_weight_fake_quant(wm, channel_wise, int(transposed))
    return nn.functional.linear(x, wq.t() if transposed else wq, b)


CASES = [  # x shape, transposed, bias, masked, channel_wise
    ((2, 7, 64), False, True, True, True),
    ((5, 64), False, False, True, True),
    ((3, 64), True, True, True, True),
    ((2, 9, 64), True, False, True, False),
    ((2, 9, 64), False, True, True, None),
    ((4, 64), False, True, False, True),
]


def _case(shape, transposed, bias, masked, out_f=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(*((64, out_f) if transposed else (out_f, 64)), generator=g, requires_grad=True)
    b = torch.randn(out_f, generator=g, requires_grad=True) if bias else None
    mask = pack_bits(compute_nm_mask(w.detach(), 0 if transposed else 1, as_bool=True)) if masked else None
    dy = torch.randn(*shape[:-1], out_f, generator=g)
    return x, w, b, mask, dy


def _both_paths(shape, transposed, bias, masked, channel_wise):
    x, w, b, mask, dy = _case(shape, transposed, bias, masked)
    inputs = [x, w] + ([b] if bias else [])
    y_ref = _composed(x, w, b, mask, channel_wise, transposed)
    ref = torch.autograd.grad(y_ref, inputs, dy)
    RT.release()
    y, scales = masked_quant_linear(x, w, b, mask, channel_wise, transposed, RT)
    after_forward = _names()
    got = torch.autograd.grad(y, inputs, dy)
    assert after_forward == ({"weight"} if fused_linear.SLICED_MAX_ROWS < x.numel() // 64 else {"slice"})
    assert (scales is None) == (channel_wise is None)
    if channel_wise is not None:  # the scales of mask(w), bit for bit, whichever path
        wm = w.detach() if mask is None else masked_ste(w.detach(), mask, apply_bits)
        assert torch.equal(scales, arq_scales(wm, channel_wise, int(transposed)))
    return y, y_ref, got, ref


@pytest.mark.parametrize("chunk", [None, 7 * 64 + 5])  # one slice; several, the last one short
@pytest.mark.parametrize("shape,transposed,bias,masked,channel_wise", CASES)
def test_the_whole_weight_path_is_bit_identical_to_the_composed_path(shape, transposed, bias, masked,
                                                                     channel_wise, chunk, monkeypatch):
    monkeypatch.setattr(fused_linear, "SLICED_MAX_ROWS", 0)  # E built whole, then one matmul
    if chunk is not None:  # the effective weight is built a slice of rows at a time
        monkeypatch.setattr(fused_linear, "_CHUNK_ELEMS", chunk)
        assert len(fused_linear._row_slices(torch.empty(96, 64))) > 2
    y, y_ref, got, ref = _both_paths(shape, transposed, bias, masked, channel_wise)
    assert torch.equal(y, y_ref)
    for a, r in zip(got, ref):
        assert torch.equal(a, r)


@pytest.mark.parametrize("chunk", [None, 7 * 64 + 5])
@pytest.mark.parametrize("shape,transposed,bias,masked,channel_wise", CASES)
def test_the_sliced_product_matches_the_composed_path(shape, transposed, bias, masked, channel_wise, chunk,
                                                      monkeypatch):
    """Few input rows: E's slices are multiplied as they are built, as columns of the result or
    as parts of its sum. Only the summation order differs (a few ulps): the products with E are
    within 1e-5, what does not go through E (the weight and bias gradients) is bit-identical."""
    if chunk is not None:
        monkeypatch.setattr(fused_linear, "_CHUNK_ELEMS", chunk)
    y, y_ref, got, ref = _both_paths(shape, transposed, bias, masked, channel_wise)
    assert _names() == {"slice"}  # E never whole
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    for a, r in zip(got[1:], ref[1:]):
        assert torch.equal(a, r)


def test_many_input_rows_multiply_the_whole_weight(monkeypatch):
    monkeypatch.setattr(fused_linear, "SLICED_MAX_ROWS", 4)
    RT.release()
    y, y_ref, got, ref = _both_paths((5, 64), False, True, True, True)  # 5 rows > 4: "weight" only
    assert torch.equal(y, y_ref)


def test_a_backward_after_a_later_forward_recomputes_its_own_weight():
    # Layers share one scratch: the first one's backward must not read what the second wrote.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 32, generator=g)
    w1 = torch.randn(48, 32, generator=g, requires_grad=True)
    w2 = (torch.randn(48, 32, generator=g) * 5).requires_grad_(True)
    x1 = x.clone().requires_grad_(True)
    y1, _ = masked_quant_linear(x1, w1, None, None, True, False)
    y2, _ = masked_quant_linear(x, w2, None, None, True, False)
    (gx1,) = torch.autograd.grad(y1.sum(), [x1])
    x_ref = x.clone().requires_grad_(True)
    (gx_ref,) = torch.autograd.grad(_composed(x_ref, w1, None, None, True, False).sum(), [x_ref])
    assert torch.equal(gx1, gx_ref)
    assert y2.shape == y1.shape


def _layer() -> CompressedLayer:
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    layer = CompressedLayer.wrap(lin, sparsity=NMSparsifier.from_module(lin, 0), wts_quant=WeightARQ(True))
    layer.large = RT  # as build attaches a CPU model's runtime
    return layer


def _scratch_ptrs() -> set[int]:
    return {t.data_ptr() for k, t in RT.scratch.tensors.items() if k[0] not in ("index", "flags")}


def test_training_steps_reuse_one_scratch_and_eval_gives_it_back():
    layer = _layer().train()
    x = torch.randn(4, 64)
    RT.release()
    layer(x).sum().backward()
    ptrs = _scratch_ptrs()
    assert len(ptrs) == 1  # the layer ran the fused path
    layer.zero_grad(set_to_none=True)
    layer(x).sum().backward()
    assert _scratch_ptrs() == ptrs  # no new weight-sized tensor
    assert layer.weight_scales() is layer.wts_quant.last_scales  # the record reuses the step's scales
    assert not any("scratch" in k for k in layer.state_dict())
    layer.eval()
    assert not RT.scratch.tensors


def test_the_fused_step_trains_like_the_composed_one():
    fused, composed = _layer().train(), _layer().train()
    x = torch.randn(8, 64)
    RT.release()
    fused(x).square().sum().backward()
    assert RT.scratch.tensors  # the fused path ran
    w, mask = composed.weight, composed.sparsity.current_bits(composed.weight)
    _composed(x, w, composed.bias, mask, True, False).square().sum().backward()
    # The loss's gradient is 2y, and y may differ by a few ulps (the sliced product).
    torch.testing.assert_close(fused.weight.grad, composed.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.bias.grad, composed.bias.grad, rtol=1e-5, atol=1e-5)


def test_apply_mask_is_w_times_mask_bit_for_bit():
    w = torch.tensor([[-1.5, 2.0, float("nan"), -0.0], [3.0, -4.0, float("inf"), 1.0]])
    mask = torch.tensor([[False, True, False, True], [True, False, False, True]])
    got, ref = apply_mask(w, mask), w * mask
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # -0.0 and NaN included
    out = torch.empty_like(w)
    assert apply_mask(w, mask, out) is out
    fmask = mask.float()
    assert torch.equal(apply_mask(w, fmask).view(torch.int32), (w * fmask).view(torch.int32))


def test_model_code_may_modify_the_output_in_place():
    # HF Wav2Vec2 adds to a projection's output in place; a custom Function's output that is a
    # view cannot be (autograd refuses), so the 3-D case must not return one.
    fused, composed = _layer().train(), _layer().train()
    x = torch.randn(2, 5, 64)
    y = fused(x)
    y += 1.0
    y.square().sum().backward()
    mask = composed.sparsity.current_bits(composed.weight)
    y_ref = _composed(x, composed.weight, composed.bias, mask, True, False)
    y_ref += 1.0
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.weight.grad, composed.weight.grad, rtol=1e-5, atol=1e-5)


def test_training_under_autocast_takes_the_composed_path():
    layer = _layer().train()
    x = torch.randn(2, 5, 64)
    RT.release()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16
    assert layer.weight.grad.dtype == torch.float32 and bool(layer.weight.grad.abs().sum() > 0)
    assert not RT.scratch.tensors


def _conv1d_layer(sparse: bool, channel_wise) -> CompressedLayer:
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D(32, 64)  # weight [64, 32]
    torch.nn.init.normal_(conv1d.bias)
    layer = CompressedLayer.wrap(conv1d, sparsity=NMSparsifier.from_module(conv1d, 0) if sparse else None,
                                 wts_quant=None if channel_wise is None else WeightARQ(channel_wise))
    layer.large = RT
    return layer


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("sparse,channel_wise", [(True, True), (True, False), (False, True), (True, None)])
def test_eval_without_grad_computes_as_a_training_step(kind, sparse, channel_wise):
    """Eval under no_grad (no weight-sized allocation per layer, for large models) gives what the
    composed eval gives: outputs (within the sliced product's few ulps), the bias on the int32
    grid, and bit for bit the scales the record reads."""
    from openamct.quant.quantizers import ActULQ

    torch.manual_seed(5)
    if kind == "linear":
        lin = nn.Linear(64, 32)
        layer = CompressedLayer.wrap(lin, sparsity=NMSparsifier.from_module(lin, 0) if sparse else None,
                                     wts_quant=None if channel_wise is None else WeightARQ(channel_wise),
                                     act_quant=ActULQ())
        layer.large = RT
    else:
        layer = _conv1d_layer(sparse, channel_wise)
        layer.act_quant = ActULQ()
    x = torch.randn(3, 5, 64)
    layer.train()
    layer(x).sum().backward()  # masks and clips initialised
    layer.eval()
    RT.release()
    with torch.no_grad():
        y = layer(x)
        seen = layer._scales_seen
    assert RT.scratch.tensors  # the scratch path ran
    RT.release()
    y_ref = layer(x)  # grad enabled: the composed path
    assert not RT.scratch.tensors
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    if channel_wise is not None:
        assert torch.equal(seen[1], layer._scales_seen[1]) and seen[0] == layer._scales_seen[0]


@pytest.mark.parametrize("transposed", [False, True])
def test_a_layer_without_outputs_gives_empty_outputs_and_zero_input_gradients(transposed):
    w = torch.randn(*((8, 0) if transposed else (0, 8)), requires_grad=True)
    x = torch.randn(3, 8, requires_grad=True)
    y, _ = masked_quant_linear(x, w, None, None, None, transposed)
    assert y.shape == (3, 0)
    (gx,) = torch.autograd.grad(y.sum(), [x])
    assert torch.equal(gx, torch.zeros(3, 8))


def test_only_a_cpu_layer_and_input_take_the_large_path():
    """Branch point of the layer forward: any other device (CUDA, meta) keeps the plain path,
    and so does a layer no runtime was attached to (a model built off the CPU)."""
    from openamct.large.fused_linear import takes_large_path
    from openamct.large.runtime import large_path_wanted

    layer = _layer().train()
    x = torch.randn(4, 64)
    assert takes_large_path(layer, x)
    assert not takes_large_path(layer, x.to("meta"))
    meta = _layer().to("meta").train()
    assert not takes_large_path(meta, torch.randn(4, 64, device="meta"))
    assert not large_path_wanted(nn.Sequential(meta)) and large_path_wanted(nn.Sequential(_layer()))
    layer.large = None
    assert not takes_large_path(layer, x)
    RT.release()
    layer(x).sum().backward()  # the plain path: no scratch
    assert not _names()
