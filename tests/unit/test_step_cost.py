"""What a steady training step costs on any device, counted on the CPU: the ops it dispatches
against the plain model's, the tensors it clones, the values it reads back to the host (kernel
internal checks included) and the tensors it copies from the host to the device.

Why the CPU can stand in for an accelerator here: a compressed model runs the same ops on every
device (asserted below against the meta device), so what the CPU dispatches is what a GPU
launches, and a host read the CPU makes is a synchronisation a GPU would make."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import openamct as amct

INT8 = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 0 } } }\n"
FILTER = ("prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 "
          "ascend_optimized: false } } }\n")
CONFIGS = {"int8": INT8, "2:4+int8": INT8 + NM, "filter+int8": INT8 + FILTER}
# Ops that only alias their input (no kernel launch).
VIEWS = {"view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "expand", "reshape", "unsqueeze",
         "squeeze", "detach", "alias", "select", "slice", "_reshape_alias", "unflatten", "flatten", "split",
         "unbind", "narrow", "view_as", "expand_as"}
# The bad-value guard's read of the outputs' finiteness: the one host read a steady step makes.
GUARD = {"aten.isfinite.default", "aten.all.default", "aten._local_scalar_dense.default"}


class CNN(nn.Module):
    """Two convs with BatchNorm, two Linears."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.fc2(torch.relu(self.fc1(x.mean((2, 3)))))


class Ops(TorchDispatchMode):
    """Every op dispatched, views aside; and every copy of a host tensor to another device."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.host_to_device = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.ops.append(str(func))
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("_to_copy", "copy_", "to"):
            srcs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if any(s.device.type == "cpu" for s in srcs) and any(
                    isinstance(o, torch.Tensor) and o.device.type != "cpu" for o in outs):
                self.host_to_device += 1
        return out


def _step(model, x):
    model(x).square().mean().backward()


def _steady(model, x, optimizer_step: bool):
    """Calibrated (two steps), then left as after an optimizer step (the next step recomputes
    the clips' quantization parameters, ``act_qparams``), or after a step that only accumulated
    gradients (they stand)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):
        _step(model, x)
        opt.step()
    if not optimizer_step:
        _step(model, x)
    return model


def _created(tmp_path, cfg):
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    (tmp_path / "c.cfg").write_text(CONFIGS[cfg])
    torch.manual_seed(0)
    m = amct.create_compressed_retrain_model(CNN(), x, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"))
    return m.train(), x


def _ops(model, x) -> list[str]:
    with Ops() as ops:
        _step(model, x)
    return ops.ops


@pytest.fixture(scope="module")
def plain_ops():
    """The float model's steady step, gradients accumulating as in the compressed model's."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16)
    return len(_ops(_steady(CNN().train(), x, False), x))


@pytest.mark.parametrize("after_optimizer_step", [False, True], ids=["accumulating", "after-optimizer-step"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_a_steady_step_dispatches_at_most_4x_the_plain_models_ops_and_clones_nothing(
        tmp_path, cfg, after_optimizer_step, plain_ops):
    m, x = _created(tmp_path, cfg)
    _steady(m, x, after_optimizer_step)
    ops = _ops(m, x)
    assert len(ops) <= 4 * plain_ops, (len(ops), plain_ops, collections.Counter(ops).most_common(12))
    assert "aten.clone.default" not in ops


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_a_steady_step_reads_back_only_the_bad_value_guards_flag(tmp_path, cfg):
    """The profiler records ops called inside other ops' kernels too: a range check that reads
    a zero point back (``fake_quantize_per_channel_affine`` with an int32 one) counts here."""
    m, x = _created(tmp_path, cfg)
    _steady(m, x, True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(m, x)
    reads = sum(e.name == "aten::_local_scalar_dense" for e in prof.events())
    assert reads == 1, reads


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_the_cpu_runs_the_ops_another_device_runs_and_copies_nothing_to_it(tmp_path, cfg):
    """The same op sequence on the CPU and on the meta device (which stands in for an
    accelerator: any value read back fails there), the guard's read aside, and no host tensor
    copied to the device in the step."""
    m, x = _created(tmp_path, cfg)
    _steady(m, x, False)
    on_cpu = [op for op in _ops(m, x) if op not in GUARD]
    m.to("meta")
    xm = x.to("meta")
    _step(m, xm)  # the first forward on the device makes its tables there
    with Ops() as ops:
        _step(m, xm)
    assert [op for op in ops.ops if op not in GUARD] == on_cpu
    assert ops.host_to_device == 0


def test_an_eval_pass_quantizes_no_weight_and_sees_every_change(tmp_path):
    """Eval forwards keep the folded, masked, quantized weights while nothing they are made of
    changes: no weight reduction in the second forward, and a changed weight, BatchNorm
    statistic or mask is seen by the next one."""
    m, x = _created(tmp_path, "2:4+int8")
    _steady(m, x, True)
    m.eval()
    with torch.no_grad():
        first = m(x)
        with Ops() as counted:
            again = m(x)
        assert torch.equal(again, first)
        assert "aten.linalg_vector_norm.default" not in counted.ops, collections.Counter(counted.ops)
        for change in (lambda: m.c1.weight.mul_(1.5), lambda: m.c2.bn.running_var.mul_(4.0),
                       lambda: m.fc1.sparsity.mask_bits.zero_()):
            before = m(x)
            change()
            after = m(x)
            for layer in (m.c1, m.c2, m.fc1, m.fc2):
                layer.__dict__.pop("_eval_kept", None)
            assert torch.equal(after, m(x)) and not torch.equal(after, before)
