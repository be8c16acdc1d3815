"""CompressedLayer: BN folding, eval identity, state round trip, training, ONNX export."""

from __future__ import annotations

import copy
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from openamct.compressed.layer import CompressedLayer
from openamct.quant.bn_fold import bn_scale
from openamct.quant.functions import arq_scales, fake_quant_per_channel
from openamct.quant.quantizers import ActULQ, WeightARQ, WeightULQ


def _randomise_bn(bn: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    c = bn.num_features
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(c, generator=g) * 0.5)
        bn.running_var.copy_(torch.rand(c, generator=g) * 2 + 0.2)
        bn.weight.copy_(torch.randn(c, generator=g))  # some negative gammas
        bn.bias.copy_(torch.randn(c, generator=g) * 0.3)
    return bn


CASES = {
    "conv2d": (lambda: nn.Conv2d(6, 8, 3, padding=1), lambda: nn.BatchNorm2d(8), (2, 6, 9, 9)),
    "conv2d_nobias_stride": (lambda: nn.Conv2d(6, 8, 3, stride=2, bias=False), lambda: nn.BatchNorm2d(8), (2, 6, 9, 9)),
    "conv2d_groups_reflect": (lambda: nn.Conv2d(6, 8, 3, padding=1, groups=2, padding_mode="reflect"),
                              lambda: nn.BatchNorm2d(8), (2, 6, 9, 9)),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, dilation=2), lambda: nn.BatchNorm1d(6), (3, 4, 20)),
    "conv3d": (lambda: nn.Conv3d(3, 4, 3, padding=1), lambda: nn.BatchNorm3d(4), (2, 3, 5, 5, 5)),
    "convT2d_groups": (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, output_padding=1, groups=2),
                       lambda: nn.BatchNorm2d(6), (2, 4, 5, 5)),
    "convT1d": (lambda: nn.ConvTranspose1d(4, 5, 4, stride=2), lambda: nn.BatchNorm1d(5), (2, 4, 7)),
    "linear": (lambda: nn.Linear(7, 5), lambda: nn.BatchNorm1d(5), (6, 7)),
}


def _make(case: str, seed: int = 0):
    torch.manual_seed(seed)
    mk_mod, mk_bn, shape = CASES[case]
    return mk_mod(), _randomise_bn(mk_bn(), seed + 1), torch.randn(*shape)


@pytest.mark.parametrize("case", sorted(CASES))
def test_eval_fold_without_quant_matches_module_then_bn(case):
    mod, bn, x = _make(case)
    ref = bn.eval()(mod.eval()(x))
    layer = CompressedLayer.wrap(copy.deepcopy(mod), bn=copy.deepcopy(bn)).eval()
    assert torch.allclose(layer(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_eval_forward_is_op_of_effective_weight_bias(case):
    mod, bn, x = _make(case, seed=3)
    layer = CompressedLayer.wrap(mod, bn=bn, act_quant=ActULQ(), wts_quant=WeightARQ(True))
    layer.train()
    layer(x)  # initialises clips, updates BN
    layer.eval()
    y = layer(x)
    expected = layer._op(layer.act_quant(x), *layer.effective_weight_bias())
    assert torch.equal(y, expected)
    assert not torch.allclose(y, layer._op(x, *layer.effective_weight_bias()))  # quant is active


def test_recorded_weight_scale_includes_bn_scale():
    mod, bn, _ = _make("conv2d")
    layer = CompressedLayer.wrap(mod, bn=bn, wts_quant=WeightARQ(True)).eval()
    c = bn_scale(bn).detach()
    expected = (mod.weight.detach() * c.view(-1, 1, 1, 1)).abs().amax(dim=(1, 2, 3)) / 127
    assert torch.allclose(layer.weight_scales(), expected)
    w_eff, _ = layer.effective_weight_bias()
    k = w_eff.detach() / expected.view(-1, 1, 1, 1)
    assert torch.allclose(k, torch.round(k), atol=1e-3) and k.abs().max().item() == pytest.approx(127)


def test_training_fold_equals_torch_ao_formula():
    mod, bn, x = _make("conv2d", seed=5)
    layer = CompressedLayer.wrap(copy.deepcopy(mod), bn=copy.deepcopy(bn), wts_quant=WeightARQ(True)).train()
    y = layer(x)
    # torch.ao's approximate fold, written out: BN_train(conv(x, q(w*c)) / c + b)
    ref_bn = copy.deepcopy(bn).train()
    c = bn_scale(ref_bn).detach()
    wq = fake_quant_per_channel(mod.weight.detach() * c.view(-1, 1, 1, 1),
                                arq_scales(mod.weight.detach() * c.view(-1, 1, 1, 1), True))
    z = F.conv2d(x, wq, None, 1, 1) / c.view(1, -1, 1, 1) + mod.bias.detach().view(1, -1, 1, 1)
    assert torch.allclose(y, ref_bn(z), atol=1e-4)
    assert torch.allclose(layer.bn.running_mean, ref_bn.running_mean, atol=1e-6)


@pytest.mark.parametrize("wq", ["arq_tensor", "ulq"])
def test_training_fold_literal_path(wq):
    mod, bn, x = _make("conv2d", seed=6)
    q = WeightARQ(False) if wq == "arq_tensor" else WeightULQ(True)
    layer = CompressedLayer.wrap(mod, bn=bn, wts_quant=q).train()
    assert not q.commutes_with_channel_scale
    y = layer(x)
    y.square().mean().backward()
    assert torch.isfinite(y).all() and layer.weight.grad is not None
    if wq == "ulq":
        assert q.scale.grad is not None and q.scale.shape == (8,)


def test_training_step_updates_clips_bn_stats_and_weights():
    mod, bn, x = _make("conv2d", seed=7)
    layer = CompressedLayer.wrap(mod, bn=bn, act_quant=ActULQ(), wts_quant=WeightARQ(True)).train()
    layer(x)  # init
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    target = torch.randn_like(layer(x))
    opt.zero_grad()
    F.mse_loss(layer(x), target).backward()
    assert layer.act_quant.clip_max.grad.abs().item() > 0
    opt.step()
    after = layer.state_dict()
    for key in ("act_quant.clip_max", "act_quant.clip_min", "bn.running_mean", "bn.running_var", "weight"):
        assert not torch.equal(before[key], after[key]), key
    assert after["bn.num_batches_tracked"].item() == before["bn.num_batches_tracked"].item() + 2


def test_state_dict_round_trip_restores_outputs_without_reinit():
    mod, bn, x = _make("conv2d", seed=8)
    layer = CompressedLayer.wrap(mod, bn=bn, act_quant=ActULQ(), wts_quant=WeightARQ(True),
                                 observe_output=True).train()
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        layer(x).square().mean().backward()
        opt.step()
    layer.eval()
    ref = layer(x)
    buf = io.BytesIO()
    torch.save({"state_dict": layer.state_dict()}, buf)
    buf.seek(0)
    mod2, bn2, _ = _make("conv2d", seed=99)
    fresh = CompressedLayer.wrap(mod2, bn=bn2, act_quant=ActULQ(), wts_quant=WeightARQ(True),
                                 observe_output=True)
    fresh.load_state_dict(torch.load(buf)["state_dict"])
    clip = fresh.act_quant.clip_max.item()
    fresh.train()
    with torch.no_grad():
        fresh(x * 10)  # a training-mode batch with a very different range must not re-initialise
    assert fresh.act_quant.clip_max.item() == clip == layer.act_quant.clip_max.item()
    fresh.load_state_dict(layer.state_dict())  # undo the BN update of that batch
    assert torch.equal(fresh.eval()(x), ref)


def test_deepcopy_and_torch_save_whole_model():
    mod, bn, x = _make("conv2d", seed=9)
    shared = ActULQ(fixed_min=True)
    model = nn.Sequential(CompressedLayer.wrap(mod, bn=bn, act_quant=shared, wts_quant=WeightARQ(True)),
                          nn.ReLU(), CompressedLayer.wrap(nn.Conv2d(8, 4, 1), act_quant=ActULQ(),
                                                          wts_quant=WeightULQ(True)))
    model.train()(x.relu())
    model.eval()
    ref = model(x.relu())
    clone = copy.deepcopy(model)
    assert torch.equal(clone(x.relu()), ref)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x.relu()), ref)


def test_shared_act_quantizer_initialises_once():
    x = torch.rand(2, 4, 6, 6) * 3
    shared = ActULQ(fixed_min=True, batch_num=2)
    a = CompressedLayer.wrap(nn.Conv2d(4, 4, 1), act_quant=shared, wts_quant=WeightARQ(True))
    b = CompressedLayer.wrap(nn.Conv2d(4, 4, 3), act_quant=shared, wts_quant=WeightARQ(True))
    a(x), b(x)
    assert int(shared.init_batches) == 1 and not bool(shared.initialized)
    a(x * 2), b(x * 2)
    assert bool(shared.initialized)
    assert a.act_quant is b.act_quant


def test_linear_on_3d_input():
    torch.manual_seed(10)
    lin = nn.Linear(16, 12)
    x = torch.randn(2, 5, 16)
    plain = CompressedLayer.wrap(copy.deepcopy(lin))
    assert torch.allclose(plain(x), lin(x), atol=1e-6)
    layer = CompressedLayer.wrap(lin, act_quant=ActULQ(), wts_quant=WeightARQ(False)).train()
    y = layer(x)
    assert y.shape == (2, 5, 12)
    y.sum().backward()
    assert layer.act_quant.clip_max.grad is not None
    layer.eval()
    flat = layer(x.reshape(10, 16)).reshape(2, 5, 12)
    assert torch.allclose(layer(x), flat, atol=1e-6)


def test_wrap_validates_arguments():
    with pytest.raises(TypeError, match="module"):
        CompressedLayer.wrap(nn.ReLU())
    with pytest.raises(ValueError, match="bn"):
        CompressedLayer.wrap(nn.Conv2d(3, 8, 3), bn=nn.BatchNorm2d(6))
    with pytest.raises(ValueError, match="running"):
        CompressedLayer.wrap(nn.Conv2d(3, 8, 3), bn=nn.BatchNorm2d(8, track_running_stats=False))
    with pytest.raises(TypeError, match="act_quant"):
        CompressedLayer.wrap(nn.Conv2d(3, 8, 3), act_quant="ulq")


def test_wrap_binds_conv_transpose_axis_and_keeps_attributes():
    ct = nn.ConvTranspose2d(4, 6, 3, groups=2)
    q = WeightARQ(True)
    layer = CompressedLayer.wrap(ct, wts_quant=q)
    assert (q.axis, q.groups) == (1, 2)
    assert layer.weight is ct.weight and layer.bias is ct.bias
    assert (layer.in_channels, layer.out_channels, layer.layer_type) == (4, 6, "ConvTranspose2d")
    assert layer.weight_scales().shape == (6,)
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_sparsity_module_applied_before_bn_scale_and_quant():
    class HalfMask(nn.Module):
        def forward(self, w):
            m = torch.ones_like(w)
            m[:, ::2] = 0
            return w * m
    mod, bn, x = _make("conv2d", seed=11)
    layer = CompressedLayer.wrap(mod, bn=bn, sparsity=HalfMask(), wts_quant=WeightARQ(True)).eval()
    w, _ = layer.effective_weight_bias()
    assert torch.all(w[:, ::2] == 0) and torch.any(w[:, 1::2] != 0)


def _export_and_run(layer: nn.Module, x: torch.Tensor):
    buf = io.BytesIO()
    torch.onnx.export(layer, (x,), buf, dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"])
    model = onnx.load_from_string(buf.getvalue())
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    return [n.op_type for n in model.graph.node], sess.run(None, {"x": x.numpy()})[0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", ["conv2d", "convT2d_groups", "linear3d"])
def test_onnx_export_has_qdq_and_matches_torch(case):
    if case == "linear3d":
        torch.manual_seed(12)
        mod, bn, x = nn.Linear(8, 6), None, torch.randn(2, 4, 8)
    else:
        mod, bn, x = _make(case, seed=12)
    layer = CompressedLayer.wrap(mod, bn=bn, act_quant=ActULQ(), wts_quant=WeightARQ(True))
    layer.train()
    for _ in range(2):
        layer(x)
    layer.eval()
    with torch.no_grad():
        ref = layer(x).numpy()
    ops, out = _export_and_run(layer, x)
    assert ops.count("QuantizeLinear") >= 2 and ops.count("DequantizeLinear") >= 2
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("train", [True, False])
def test_first_layer_output_accepts_inplace_relu(train):
    torch.manual_seed(14)
    conv = nn.Conv2d(3, 8, 3)
    model = nn.Sequential(CompressedLayer.wrap(conv, act_quant=ActULQ(), wts_quant=WeightARQ(True)),
                          nn.ReLU(inplace=True)).train(train)
    x = torch.randn(2, 3, 8, 8)
    y = model(x)
    y.sum().backward()
    assert model[0].act_quant.clip_max.grad is not None and conv.weight.grad is not None
    assert torch.equal(y, torch.relu(model[0]._op(model[0].act_quant(x), *model[0].effective_weight_bias())))


@pytest.mark.parametrize("case", ["conv2d", "conv2d_groups_reflect", "convT2d_groups", "linear"])
@pytest.mark.parametrize("clips", [(8.0, -8.0, False), (1.0, -0.6, False), (1.2, -1.0, True)])
def test_first_layer_clip_gradients_match_autograd(case, clips):
    # x without requires_grad takes the forward-op shortcut for the clip gradients; x with
    # requires_grad takes plain autograd through the op's backward. Same results expected.
    mod, bn, x = _make(case, seed=13)
    grads = []
    for need_x_grad in (False, True):
        layer = CompressedLayer.wrap(copy.deepcopy(mod), bn=copy.deepcopy(bn).train(),
                                     act_quant=ActULQ(*clips[:2], fixed_min=clips[2]),
                                     wts_quant=WeightARQ(True)).train()
        xi = x.clone().requires_grad_(need_x_grad)
        out = torch.relu_(layer(xi))  # in-place consumer, as in a ResNet stem
        (out * torch.linspace(-1, 2, out.numel()).reshape(out.shape)).sum().backward()
        aq = layer.act_quant
        grads.append((out.detach(), aq.clip_max.grad, aq.clip_min.grad, layer.weight.grad))
    (o1, mx1, mn1, w1), (o2, mx2, mn2, w2) = grads
    assert torch.equal(o1, o2) and torch.allclose(w1, w2, rtol=1e-5, atol=1e-6)
    assert mx2.abs().item() > 0
    assert torch.allclose(mx1, mx2, rtol=1e-4, atol=1e-5 * (1 + mx2.abs().item()))
    if clips[2]:
        assert mn1 is None and mn2 is None
    else:
        assert torch.allclose(mn1, mn2, rtol=1e-4, atol=1e-5 * (1 + mn2.abs().item()))
