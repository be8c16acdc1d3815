"""A layer subclass with its own forward (timm's Conv2dSame pads TF-"same" there) stays float:
a compressed layer would run the base class's op in its place, losing the padding. The model
still compresses its other layers, trains, restores and saves, one WARNING names the layer and
the reason, and the float layer computes what it did before."""

import logging

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import openamct as amct
from openamct.compressed.layer import CompressedLayer
from tests.acceptance.conftest import INT8_CFG, write_cfg
from tests.training import sgd_steps

NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 0 } } }\n"
FILTER = "prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 ascend_optimized: false } } }\n"


class SameConv(nn.Conv2d):
    """Pads its input in forward so that the output has ceil(input / stride) pixels."""

    def forward(self, x):
        k, s = self.kernel_size[0], self.stride[0]
        pad = max((-(-x.shape[-1] // s) - 1) * s + k - x.shape[-1], 0)
        return super().forward(F.pad(x, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2)))


class PlainSubclass(nn.Conv2d):
    """A subclass that only adds an attribute: compressed as before."""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = PlainSubclass(3, 16, 3, stride=2, padding=1)
        self.same = SameConv(16, 16, 5)  # 5x5 kernel on a 4x4 map: the plain conv refuses it
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = F.relu(self.same(x))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("extra", ["", NM, FILTER], ids=["int8", "2:4+int8", "filter+int8"])
def test_subclass_with_own_forward_stays_float(tmp_path, caplog, extra):
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        same_before = model.same(torch.relu(model.stem(x))).clone()
    cfg, rec = write_cfg(tmp_path, INT8_CFG + extra), str(tmp_path / "r.txt")
    with caplog.at_level(logging.WARNING):
        c = amct.create_compressed_retrain_model(model, x, cfg, rec)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.getMessage().startswith("layer(s) left uncompressed")]
    assert len(warnings) == 1 and "same (Conv2d)" in warnings[0] and "SameConv" in warnings[0], warnings
    assert type(c.same) is SameConv and not isinstance(c.same, CompressedLayer)
    assert isinstance(c.stem, CompressedLayer) and isinstance(c.stem, PlainSubclass)
    assert isinstance(c.head, CompressedLayer)
    # the float layer computes what it did: same weights, the padding kept (4x4 in, 4x4 out)
    stem_out = torch.relu(c.stem(x)).detach()
    with torch.no_grad():
        out = c.same(stem_out)
        assert out.shape[-2:] == stem_out.shape[-2:] == (4, 4)
        # filter pruning stops at the float layer: the stem keeps the channels it reads
        assert c.stem.weight.shape == model.stem.weight.shape
        assert torch.equal(c.same.weight, model.same.weight)
        np.testing.assert_array_equal(SameConv.forward(model.same, stem_out).numpy(), out.numpy())
    assert same_before.shape == out.shape

    sgd_steps(c, x, steps=2, lr=1e-2)
    c.eval()
    with torch.no_grad():
        ref = c(x).numpy()
    ckpt = str(tmp_path / "c.pth")
    torch.save({"state_dict": c.state_dict()}, ckpt)
    torch.manual_seed(0)
    r = amct.restore_compressed_retrain_model(Net().eval(), x, cfg, rec, ckpt, "state_dict").eval()
    with torch.no_grad():
        np.testing.assert_array_equal(r(x).numpy(), ref)
    amct.save_compressed_retrain_model(r, rec, str(tmp_path / "m"), x)
    sess = ort.InferenceSession(str(tmp_path / "m_fake_quant_model.onnx"), providers=["CPUExecutionProvider"])
    fake = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(fake, ref, rtol=1e-3, atol=1e-3)
