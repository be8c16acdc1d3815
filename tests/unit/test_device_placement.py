"""Restore, filter pruning and save on a model that is not on the CPU, checked without a GPU.

Under ``FakeTensorMode`` a tensor can be made on "cuda" in a CPU-only build and an op mixing
devices raises ``FakeTensorDeviceMismatchError``, as it would on a GPU; fake tensors hold no
values, so only code that never reads a value back can run there (the whole ``restore`` reads
values: the NaN check of the model, the clip search). Python indexing (``t[rows]``) of a fake
CUDA tensor also fails in a CPU-only build (it initialises CUDA), which is why the prune code
uses ``narrow`` / ``index_select``. What each test proves is in its docstring.
"""

from __future__ import annotations

import copy

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import openamct as amct
from openamct.export.export_layer import working_copy
from openamct.export.writer import export_pair
from openamct.sparsity.filter import apply_removal, group_scores
from openamct.sparsity.nm import NMSparsifier
from openamct.techniques.sparsity24 import mask_changes
from tests.unit.test_channel_params import ConvNextLike, TokenNet, prune
from tests.unit.test_device_step import CNN, INT8, NM, _calibrated
from tests.unit.test_filter_prune import ConcatDepthwiseNet


def _fake(model: nn.Module, mode: FakeTensorMode, device: str) -> nn.Module:
    """``model`` with every parameter and buffer replaced by a fake tensor of its shape on
    ``device`` (``.to("cuda")`` itself initialises CUDA, so the tensors are made there)."""
    for m in model.modules():
        for store in (m._parameters, m._buffers):
            for k, t in store.items():
                if t is None:
                    continue
                with mode:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                store[k] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    return model


PRUNED = [(ConcatDepthwiseNet, (2, 3, 6, 6)), (lambda: TokenNet(nn.LayerNorm(32)), (2, 5, 16)),
          (ConvNextLike, (2, 3, 8, 8))]


@pytest.mark.parametrize("device", ["cuda", "meta"])
@pytest.mark.parametrize("make,shape", PRUNED, ids=["convs-bn-depthwise-transposed", "layernorm-layerscale", "grn"])
def test_filter_pruning_scores_and_removes_on_the_weights_device(make, shape, device):
    """Channels chosen on the CPU are removed from a model on another device: every new tensor
    (convs plain, grouped, depthwise and transposed, BN, Linear, LayerNorm, a LayerScale
    parameter, a GRN) is made on that device with the CPU result's shape, and the group scores
    are summed there. Fails if an index or accumulator tensor is made on the CPU."""
    torch.manual_seed(0)
    model = make()
    groups, _ = prune(model, torch.randn(shape))
    assert any(g.removed for g in groups)
    reference = copy.deepcopy(model)
    apply_removal(reference, groups, quiet=True)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake(copy.deepcopy(model), mode, device)
    with mode:
        scores = [group_scores(dict(fake.named_modules()), g) for g in groups]
        apply_removal(fake, groups, quiet=True)
    assert all(s.device.type == device and s.shape == (g.channels,) for s, g in zip(scores, groups))
    got, want = fake.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].device.type == device and got[k].shape == want[k].shape, k


def test_restore_compares_the_records_masks_on_the_masks_device():
    """The record's 2:4 bits (read on the CPU) are compared with a CUDA layer's after the
    checkpoint loads: the comparison runs on the layer's device (comparing a CUDA and a CPU
    tensor is an error on a GPU) and yields one flag per layer there."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    sp = _fake(NMSparsifier((8, 16), 1, 0), mode, "cuda")
    recorded = {"fc": torch.zeros(16, dtype=torch.uint8)}  # a real CPU tensor, as the record gives
    with mode:
        flags = mask_changes(recorded, {"fc": sp})
    assert flags["fc"].device.type == "cuda" and flags["fc"].dtype == torch.bool and flags["fc"].dim() == 0


def test_mask_changes_finds_the_layer_whose_bits_differ():
    a, b = NMSparsifier((8, 16), 1, 0), NMSparsifier((8, 16), 1, 0)
    bits = a.mask_bits.clone()
    bits[3] ^= 1
    flags = mask_changes({"a": a.mask_bits.clone(), "b": bits}, {"a": a, "b": b})
    assert [n for n, f in flags.items() if bool(f)] == ["b"]


def test_the_save_copy_of_a_cuda_model_is_on_the_cpu_and_the_model_stays(tmp_path):
    """``working_copy(cpu=True)``, the copy the plain save exports from, holds only CPU tensors
    for a CUDA model (weights and quantizer state), and the model keeps its CUDA tensors."""
    m, _, _ = _calibrated(tmp_path, "cnn", INT8 + NM)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _fake(m, mode, "cuda")
    work = working_copy(m, cpu=True)  # fake tensors dispatch to their mode outside it too
    assert all(t.device.type == "cpu" for t in (*work.parameters(), *work.buffers()))
    assert all(t.device.type == "cuda" for t in (*m.parameters(), *m.buffers()))


def _ort(path: str, x: torch.Tensor) -> np.ndarray:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def test_the_plain_quantized_save_writes_what_the_streamed_one_does(tmp_path):
    """The save path a non-CPU model takes (``export_pair`` without ``streamed_save``), forced
    on a CPU model: both ONNX files give in ONNX Runtime exactly (bit for bit) the outputs of
    the files the CPU save (streamed) writes."""
    (tmp_path / "c.cfg").write_text(INT8 + NM)
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    m = amct.create_compressed_retrain_model(CNN(), x, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"))
    m.train()
    m(x).square().mean().backward()
    m.eval()
    m(x)
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "s"), x)
    export_pair(m, str(tmp_path / "p_fake.onnx"), str(tmp_path / "p_deploy.onnx"), x)
    probe = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    for kind in ("fake_quant", "deploy"):
        streamed = _ort(str(tmp_path / f"s_{kind}_model.onnx"), probe)
        plain = _ort(str(tmp_path / f"p_{'fake' if kind == 'fake_quant' else 'deploy'}.onnx"), probe)
        assert np.array_equal(streamed, plain), kind


def test_a_compiled_training_step_computes_what_the_eager_one_does(tmp_path):
    """``torch.compile`` of the returned model (eager backend: Dynamo's capture, graph breaks
    and guards, no code generation) runs a steady training step with the eager step's loss and
    gradients. The graph breaks it takes are listed in docs/gpu.md. A clip's gradient is a sum
    the eager CPU path forms in another order (``quant/ulq_act.py``: clips read as numbers there,
    tensors when compiled), so it agrees to float32 rounding; every other gradient bit for bit."""
    m, x, _ = _calibrated(tmp_path, "transformer", INT8)
    eager = copy.deepcopy(m)
    compiled = torch.compile(m, backend="eager")
    losses = []
    for model in (eager, compiled):
        model.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(eager.named_parameters(), m.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is None:
            continue
        if name.endswith(("clip_max", "clip_min")):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(a.grad, b.grad), name
