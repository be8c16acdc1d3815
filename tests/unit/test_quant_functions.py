"""Fake-quant Functions and quantizer modules (openamct.quant.functions / quantizers / clip_init)."""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openamct.formats import INT8_ACT
from openamct.quant import clip_init
from openamct.quant.functions import (
    arq_scales,
    fake_quant_per_channel,
    fake_quant_per_tensor,
    ulq_qparams,
    ulq_qparams_float,
)
from openamct.quant.quantizers import ActULQ, RangeObserver, WeightARQ, WeightULQ
from openamct.quant.ulq_act import ULQAct, single_row


def _builtin_pt(x, s, zp):
    return torch.fake_quantize_per_tensor_affine(x, s, zp, -128, 127)


# --- numerics shared with the built-in ops ---------------------------------------------------

@pytest.mark.parametrize("s,zp", [(0.01, 0), (0.0235, -128), (0.0173, 17), (1 / 127, 127), (3.1e-5, -3)])
def test_composite_per_tensor_is_bit_identical_to_builtin(s, zp):
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(50_000, generator=g) * 3, (torch.arange(-400, 400) + 0.5) * s,
                   torch.tensor([0.0, -0.0, 1e30, -1e30])])
    assert torch.equal(fake_quant_per_tensor(x, s, zp), _builtin_pt(x, s, zp))


def test_composite_per_channel_is_bit_identical_to_builtin():
    w = torch.randn(32, 16, 3, 3, generator=torch.Generator().manual_seed(2))
    w[5] = 0.0  # all-zero channel: scale floored, output exactly 0
    s = arq_scales(w, True)
    ref = torch.fake_quantize_per_channel_affine(w, s, torch.zeros(32, dtype=torch.int32), 0, -128, 127)
    assert torch.equal(fake_quant_per_channel(w, s), ref)
    assert torch.equal(fake_quant_per_channel(w, s, clamp=False), ref)
    assert torch.all(torch.isfinite(s)) and torch.all(ref[5] == 0)
    st = arq_scales(w, False)
    assert torch.equal(fake_quant_per_channel(w, st), _builtin_pt(w, float(st), 0))


def test_qparams_float_matches_tensor_version():
    rng = np.random.default_rng(3)
    for _ in range(300):
        cmax, cmin = float(rng.normal() * 4), float(rng.normal() * 2)
        for fixed in (False, True):
            s, zp, cmx, cmn = ulq_qparams(torch.tensor(cmax), torch.tensor(cmin), fixed)
            assert ulq_qparams_float(cmax, cmin, fixed) == (s.item(), int(zp.item()), cmx.item(), cmn.item())
            assert -128 <= int(zp) <= 127 and s.item() > 0


# --- ULQ activations -------------------------------------------------------------------------

def _ulq_reference(x, cmax, cmin, fixed_min, g):
    """The ULQ formulas of docs/dev/reference.md (upstream's) in float64, independent of the
    implementation."""
    x64, g64 = x.double(), g.double()
    cmax, cmin = max(cmax, 0.0), (0.0 if fixed_min else min(cmin, 0.0))
    s = np.float32((np.float32(cmax) - np.float32(cmin)) / np.float32(255))
    o = float(np.round(np.float32(-128) - np.float32(cmin) / s))
    s = float(s)
    y = (torch.clamp(torch.round(x64 / s + o), -128, 127) - o) * s
    upper = x64 > (127 - o) * s
    lower = x64 < (-128 - o) * s
    r = torch.where(upper, torch.full_like(x64, cmax), torch.where(lower, torch.full_like(x64, cmin), x64)) / s
    e = (torch.round(r) - r) / 255
    gmax = ((e + upper.double()) * g64).sum()
    gmin = ((lower.double() - e) * g64).sum()
    gx = torch.where(upper | lower, torch.zeros_like(g64), g64)
    return y, gx, gmax, gmin


@pytest.mark.parametrize("cmax,cmin,fixed", [(3.0, -1.0, False), (2.5, -0.7, True), (1.3, -2.2, False)])
def test_ulq_forward_and_gradients_match_reference(cmax, cmin, fixed):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(4, 8, 20, 20, generator=gen) * 1.5).requires_grad_()
    g = torch.randn(4, 8, 20, 20, generator=gen)
    pmax, pmin = torch.nn.Parameter(torch.tensor(cmax)), torch.nn.Parameter(torch.tensor(cmin))
    y = ULQAct.apply(x, pmax, pmin, single_row(pmax, pmin, fixed, INT8_ACT))
    y.backward(g)
    y_ref, gx_ref, gmax_ref, gmin_ref = _ulq_reference(x.detach(), cmax, cmin, fixed, g)
    assert torch.allclose(y.double(), y_ref, atol=1e-6)
    assert torch.equal(x.grad, gx_ref.float())
    assert (x.grad == 0).any() and (x.grad != 0).any()  # both regions exercised
    assert math.isclose(pmax.grad.item(), gmax_ref.item(), rel_tol=1e-4, abs_tol=1e-3)
    if fixed:
        assert pmin.grad is None
    else:
        assert math.isclose(pmin.grad.item(), gmin_ref.item(), rel_tol=1e-4, abs_tol=1e-3)


def test_ulq_clip_gradient_sign_follows_loss():
    # Loss = sum(y): raising cmax lets more large values through -> positive gradient.
    x = torch.linspace(0, 10, 10_000)
    q = ActULQ(clip_max=5.0, clip_min=-1.0, fixed_min=True)
    q(x).sum().backward()
    assert q.clip_max.grad.item() > 1000  # ~ number of clipped elements (upper + e)
    assert q.clip_min.grad is None


def test_fixed_min_pins_zero_and_ignores_clip_min():
    x = torch.randn(1000) * 2
    a = ActULQ(clip_max=4.0, clip_min=-3.0, fixed_min=True)
    b = ActULQ(clip_max=4.0, clip_min=-0.5, fixed_min=True)
    assert torch.equal(a(x), b(x))
    s, zp = a.scale_offset()
    assert zp == -128 and math.isclose(s, 4.0 / 255, rel_tol=1e-6)
    assert a(x).min().item() == 0.0


def test_eval_no_grad_path_equals_builtin():
    q = ActULQ(clip_max=2.0, clip_min=-1.0).eval()
    x = torch.randn(3, 5, 7)
    s, zp = q.scale_offset()
    with torch.no_grad():
        assert torch.equal(q(x), _builtin_pt(x, s, zp))


# --- clip initialisation ---------------------------------------------------------------------

def test_clip_init_uniform_distribution():
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(5)) * 4.0
    q = ActULQ(fixed_min=True)
    q(x)
    assert bool(q.initialized) and q.clip_min.item() == 0.0
    assert 3.9 <= q.clip_max.item() <= 4.1  # no outliers: the MSE optimum is the true max


def test_clip_init_search_picks_mse_minimum():
    gen = torch.Generator().manual_seed(6)
    x = torch.cat([torch.randn(20_000, generator=gen), torch.tensor([9.0, -7.0])])
    assert clip_init.percentile_max_min(x)[0] < 5.0  # the two outliers are ignored
    hi, lo = 9.0, -7.0  # the search itself, from upstream's true extremes
    best_max, best_min = clip_init.search_clips(x, hi, lo, fixed_min=False)

    def mse(cmax, cmin):  # upstream-style loop, one candidate at a time
        s, zp, _, _ = ulq_qparams_float(cmax, cmin, False)
        return ((fake_quant_per_tensor(x, s, zp) - x) ** 2).mean().item()
    cands = [r / 100 * hi for r in range(70, 131)]
    losses = [mse(c, lo) for c in cands]
    assert math.isclose(best_max, cands[int(np.argmin(losses))], rel_tol=1e-6)
    assert best_max < hi  # outlier clipped
    assert mse(best_max, best_min) <= mse(best_max, lo) + 1e-12


def test_clip_init_batch_num_and_shared_call_dedup():
    gen = torch.Generator().manual_seed(7)
    b1, b2 = torch.rand(5000, generator=gen) * 2, torch.rand(5000, generator=gen) * 6
    q = ActULQ(batch_num=2, fixed_min=True)
    q(b1)
    q(b1)  # same tensor again (a second consumer): not a new batch
    assert not bool(q.initialized) and int(q.init_batches) == 1
    c1 = q.clip_max.item()
    q(b2)
    assert bool(q.initialized) and int(q.init_batches) == 2
    (c2, _), _ = clip_init.init_clips(b2, True, running=(2.0, 0.0))
    assert math.isclose(q.clip_max.item(), (c1 + c2) / 2, rel_tol=1e-5)
    before = q.clip_max.item()
    q(torch.rand(5000) * 100)  # initialised: clips never move again on their own
    assert q.clip_max.item() == before


def test_given_clips_are_initialised_and_validated():
    q = ActULQ(clip_max=3.0, clip_min=-1.0)
    assert bool(q.initialized)
    q(torch.randn(100) * 50)
    assert q.clip_max.item() == 3.0
    with pytest.raises(ValueError, match="clip_max"):
        ActULQ(clip_max=-1.0, clip_min=-2.0)
    with pytest.raises(ValueError, match="clip_min"):
        ActULQ(clip_max=1.0, clip_min=0.5)
    with pytest.raises(ValueError, match="batch_num"):
        ActULQ(batch_num=0)
    with pytest.raises(TypeError, match="fixed_min"):
        ActULQ(fixed_min=1)


def _dist_worker(rank, world, path, out):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        x = torch.rand(4000, generator=torch.Generator().manual_seed(rank)) * (2 + 3 * rank)
        q = ActULQ(fixed_min=True)
        q(x)
        torch.save({"clip": q.clip_max.detach().clone(), "local": clip_init.init_clips(x, True)[0][0]},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_clip_init_averages_across_ranks():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_dist_worker, args=(2, os.path.join(d, "store"), os.path.join(d, "res")), nprocs=2)
        r0, r1 = (torch.load(os.path.join(d, f"res.{r}")) for r in (0, 1))
    assert torch.equal(r0["clip"], r1["clip"])
    assert math.isclose(r0["clip"].item(), (r0["local"] + r1["local"]) / 2, rel_tol=1e-5)


# --- weights ---------------------------------------------------------------------------------

def test_arq_per_channel_and_per_tensor_values():
    w = torch.randn(8, 4, 3, 3, generator=torch.Generator().manual_seed(8))
    s = WeightARQ(True).scales(w)
    assert torch.allclose(s, w.abs().amax(dim=(1, 2, 3)) / 127)
    y = WeightARQ(True)(w)
    k = torch.round(y / s.view(-1, 1, 1, 1))
    assert torch.allclose(y, k * s.view(-1, 1, 1, 1)) and k.abs().max() == 127
    st = WeightARQ(False).scales(w)
    assert st.shape == (1,) and math.isclose(st.item(), w.abs().max().item() / 127, rel_tol=1e-6)
    assert len(torch.unique(WeightARQ(False)(w) / st)) <= 255


def test_arq_backward_is_identity():
    w = torch.randn(6, 5, requires_grad=True)
    g = torch.randn(6, 5)
    WeightARQ(True)(w).backward(g)
    assert torch.equal(w.grad, g)


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_transpose_scales_are_per_output_channel(groups):
    ct = torch.nn.ConvTranspose2d(4, 6, 3, groups=groups)
    w = ct.weight.detach()  # [Cin=4, Cout/g, 3, 3]
    q = WeightARQ(True, axis=1, groups=groups)
    s = q.scales(w)
    cin_g, cout_g = 4 // groups, 6 // groups
    ref = torch.stack([w[(j // cout_g) * cin_g:(j // cout_g + 1) * cin_g, j % cout_g].abs().max()
                       for j in range(6)]) / 127
    assert s.shape == (6,) and torch.allclose(s, ref)
    y = q(w)
    for j in range(6):  # each output channel's slice sits on its own grid
        sl = y[(j // cout_g) * cin_g:(j // cout_g + 1) * cin_g, j % cout_g]
        assert torch.allclose(sl / s[j], torch.round(sl / s[j]), atol=1e-4)
    if groups == 1:
        ref_fq = torch.fake_quantize_per_channel_affine(w, s, torch.zeros(6, dtype=torch.int32), 1, -128, 127)
        assert torch.equal(y, ref_fq)


def test_weight_ulq_init_and_lsq_gradient():
    w = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(9), requires_grad=True)
    q = WeightULQ(True)
    q(w)
    assert torch.allclose(q.scale.detach(), w.detach().abs().amax(dim=(1, 2)) / 127)
    with torch.no_grad():
        q.scale.mul_(0.5)  # now some weights clip
    g = torch.randn(4, 3, 5)
    q(w).backward(g)
    s = q.scale.detach().view(-1, 1, 1)
    r = w.detach() / s
    upper, lower = r > 127, r < -128
    coef = torch.where(upper, torch.full_like(r, 127.0), torch.where(lower, torch.full_like(r, -128.0), torch.round(r) - r))
    ref = (coef * g).sum(dim=(1, 2)) / math.sqrt(15 * 127)
    assert upper.any() or lower.any()
    assert torch.allclose(q.scale.grad, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(w.grad, g)


def test_range_observer_updates_only_in_training():
    ob = RangeObserver(momentum=0.5)
    ob.eval()(torch.tensor([-5.0, 5.0]))
    assert not bool(ob.initialized)
    ob.train()
    ob(torch.tensor([-1.0, 3.0]))
    assert (ob.min_val.item(), ob.max_val.item()) == (-1.0, 3.0)
    ob(torch.tensor([-3.0, 1.0]))
    assert (ob.min_val.item(), ob.max_val.item()) == (-2.0, 2.0)
    s, zp = ob.scale_offset()
    assert math.isclose(s, 4.0 / 255, rel_tol=1e-6) and zp == round(-128 + 2.0 / s)
    assert set(ob.state_dict()) == {"min_val", "max_val", "initialized"}
