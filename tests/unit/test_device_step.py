"""The per-step training path on any device: one host read in a steady step, the bad-value
guard's (counted as ``aten._local_scalar_dense`` calls), every tensor on the model's device (the meta device stands
in for an accelerator: a tensor left on the CPU or a host read fails there), and quantizers
computing in float32 under autocast."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import openamct as amct
from openamct.quant.quantizers import ActULQ

INT8 = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 0 } } }\n"
FILTER = ("prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 "
          "ascend_optimized: false } } }\n")


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.fc(x.mean((2, 3)))


class Block(nn.Module):
    """Linear/LayerNorm/GELU, a residual MLP on token embeddings."""

    def __init__(self):
        super().__init__()
        self.inp, self.ln = nn.Linear(16, 32), nn.LayerNorm(32)
        self.up, self.down, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.down(nn.functional.gelu(self.up(self.ln(h))))
        return self.head(h.mean(1))


MODELS = {"cnn": (CNN, (4, 3, 8, 8)), "transformer": (Block, (4, 5, 16))}
CASES = [("cnn", INT8), ("cnn", INT8 + NM), ("cnn", INT8 + FILTER), ("transformer", INT8),
         ("transformer", INT8 + NM)]
IDS = ["cnn-int8", "cnn-2:4+int8", "cnn-filter+int8", "transformer-int8", "transformer-2:4+int8"]


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _calibrated(tmp_path, kind: str, cfg: str):
    make, shape = MODELS[kind]
    x = torch.randn(*shape)
    (tmp_path / "c.cfg").write_text(cfg)
    m = amct.create_compressed_retrain_model(make(), x, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"))
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(2):  # batch_num 1: the first forward initialises the clips and 2:4 masks
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return m, x, opt


@pytest.mark.parametrize("kind,cfg", CASES, ids=IDS)
def test_a_steady_training_step_reads_nothing_back_from_the_device(tmp_path, kind, cfg):
    m, x, opt = _calibrated(tmp_path, kind, cfg)
    with HostReads() as reads:
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    # The bad-value guard's one read of the outputs' finiteness (training/guard.py), nothing else.
    assert reads.n == 1, reads.n


# --- meta device -----------------------------------------------------------------------------

def _fq_tensor_meta(x, scale, zero_point, *args):
    return torch.empty_like(x)


def _fq_cachemask_meta(x, *args):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


@pytest.fixture(scope="module")
def meta_fake_quant():
    """Shape-only meta kernels for the built-in fake-quant ops (torch has none for some)."""
    lib = torch.library.Library("aten", "IMPL", "Meta")
    for name, fn in (("fake_quantize_per_tensor_affine.tensor_qparams", _fq_tensor_meta),
                     ("_fake_quantize_per_tensor_affine_cachemask_tensor_qparams", _fq_cachemask_meta),
                     ("fake_quantize_per_channel_affine", _fq_tensor_meta),
                     ("fake_quantize_per_channel_affine_cachemask", _fq_cachemask_meta)):
        try:
            lib.impl(name, fn)
        except RuntimeError:  # this torch has one already
            pass
    yield
    lib._destroy()


@pytest.mark.parametrize("kind,cfg", CASES, ids=IDS)
def test_a_training_step_runs_on_another_device(tmp_path, kind, cfg, meta_fake_quant):
    m, x, _ = _calibrated(tmp_path, kind, cfg)
    m.to("meta")
    assert all(t.is_meta for t in (*m.parameters(), *m.buffers()))
    y = m(x.to("meta"))
    y.square().mean().backward()
    grads = [p.grad for n, p in m.named_parameters() if not n.endswith("clip_min")]  # fixed_min: none
    assert grads and all(g is not None and g.is_meta for g in grads)
    clips = [q.clip_max.grad for q in m.modules() if isinstance(q, ActULQ)]
    assert clips and all(g is not None and g.is_meta for g in clips)


# --- autocast ---------------------------------------------------------------------------------

def _clip_grads(q: ActULQ, x: torch.Tensor, g: torch.Tensor):
    q.clip_max.grad = q.clip_min.grad = None
    y = q(x)
    y.backward(g.to(y.dtype))
    return y.float(), q.clip_max.grad.item(), q.clip_min.grad.item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amp", [False, True])
def test_a_half_input_is_quantized_as_its_float32_cast(dtype, amp):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 256, generator=gen) * 3).to(dtype)
    g = torch.randn(64, 256, generator=gen).to(dtype).float()  # the same in either dtype
    q = ActULQ(clip_max=4.0, clip_min=-2.5)
    ref, ref_max, ref_min = _clip_grads(q, x.float(), g)
    if amp:  # float32 out: the next op casts it as autocast decides
        with torch.autocast("cpu", dtype=dtype):
            got, got_max, got_min = _clip_grads(q, x, g)
    else:  # the input's dtype out: a half model's next op needs it
        got, got_max, got_min = _clip_grads(q, x, g)
        ref = ref.to(dtype).float()
    assert torch.equal(got, ref)
    assert math.isclose(got_max, ref_max, rel_tol=1e-5) and math.isclose(got_min, ref_min, rel_tol=1e-5)


def test_an_fp16_autocast_step_with_a_loss_scale_gives_finite_clip_gradients(tmp_path):
    m, x, _ = _calibrated(tmp_path, "cnn", INT8)
    m.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = m(x)
    (out.float().square().mean() * 2.0**16).backward()  # the loss in float32, as GradScaler users write it
    grads = [g for q in m.modules() if isinstance(q, ActULQ) for g in (q.clip_max.grad, q.clip_min.grad)
             if g is not None]
    assert grads and all(bool(torch.isfinite(g)) for g in grads)
    assert any(float(g) != 0 for g in grads)
