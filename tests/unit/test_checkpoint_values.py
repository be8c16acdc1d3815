"""A checkpoint's values and dtypes are checked where they enter; each bad
one is a ValueError naming the checkpoint key."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import openamct as amct
from tests.trained_record import CONV_FC_CFG as CFG  # noqa: E402
from tests.trained_record import CONV_FC_X as X  # noqa: E402
from tests.trained_record import ConvFcNet as Net  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    (d / "c.cfg").write_text(CFG)
    m = amct.create_compressed_retrain_model(Net(), X, str(d / "c.cfg"), str(d / "rec.txt"))
    m.train()
    m(X).sum().backward()
    m.eval()
    m(X)
    return d, {k: v.clone() for k, v in m.state_dict().items()}


def _restore(d, sd, name="bad.pth"):
    torch.save({"sd": sd}, d / name)
    return amct.restore_compressed_retrain_model(Net(), X, str(d / "c.cfg"), str(d / "rec.txt"), str(d / name), "sd")


def _edit(sd, key, fn):
    sd = dict(sd)
    sd[key] = fn(sd[key].clone() if key in sd else _legacy_mask(sd, key))
    return sd


def _legacy_mask(sd, key):
    """A checkpoint from before masks were packed holds ``<layer>.sparsity.mask``: bool (or, older,
    float) of the weight's shape."""
    bits = sd.pop(key + "_bits")
    shape = sd[key.removesuffix(".sparsity.mask") + ".weight"].shape
    return torch.from_numpy(np.unpackbits(bits.numpy())[: shape.numel()].copy()).view(torch.bool).reshape(shape)


CASES = [
    ("conv.weight", lambda t: t.mul(100).long(), r"'conv.weight' has dtype torch.int64 but the model's is torch.float32"),
    ("fc.weight", lambda t: t.index_fill_(1, torch.tensor([0]), float("nan")), r"'fc.weight' holds 4 NaN/inf value"),
    # masks are packed bits now: a 0.5 can only come in a float (older) checkpoint's mask
    ("conv.sparsity.mask", lambda t: t.float().fill_(0.5), r"'conv.sparsity.mask' is a mask but holds 0.5"),
    ("conv.sparsity.mask", lambda t: t.float()[:3], r"shape mismatch conv.sparsity.mask: checkpoint \(3, 8, 3, 3\) vs model \(16, 8, 3, 3\)"),
    ("conv.sparsity.mask_bits", lambda t: t.fill_(255), r"'conv.sparsity.mask_bits' is not a 2:4 mask: \d+ group\(s\) "
                                                        r"of 4 weights keep more than 2 \(1152 of 1152 weights kept\)"),
    ("conv.sparsity.mask", lambda t: t.fill_(True), r"'conv.sparsity.mask_bits' is not a 2:4 mask"),
    ("fc.sparsity.step", lambda t: t.double(), r"'fc.sparsity.step' has dtype torch.float64 but the model's is torch.int64"),
]


@pytest.mark.parametrize("key,fn,msg", CASES, ids=[c[2][:30] for c in CASES])
def test_bad_checkpoint_values_are_refused_naming_the_key(trained, key, fn, msg):
    d, sd = trained
    with pytest.raises(ValueError, match=r"pth_file '.*bad.pth'.*" + msg):
        _restore(d, _edit(sd, key, fn))


def test_the_clean_checkpoint_restores(trained):
    d, sd = trained
    m = _restore(d, sd, "good.pth")
    assert torch.equal(m.state_dict()["conv.weight"], sd["conv.weight"])


@pytest.mark.parametrize("old_dtype", [torch.bool, torch.float32])
def test_a_checkpoint_with_unpacked_masks_restores_the_same_masks(trained, old_dtype):
    """Checkpoints written before the masks were packed (bool, and float before that) load."""
    d, sd = trained
    old = _edit(_edit(sd, "conv.sparsity.mask", lambda t: t.to(old_dtype)), "fc.sparsity.mask",
                lambda t: t.to(old_dtype))
    assert "conv.sparsity.mask_bits" not in old and old["conv.sparsity.mask"].dtype == old_dtype
    m = _restore(d, old, "old.pth")
    for layer in ("conv", "fc"):
        assert torch.equal(m.state_dict()[f"{layer}.sparsity.mask_bits"], sd[f"{layer}.sparsity.mask_bits"])


def test_clips_that_leave_no_range_are_reported(trained, caplog):
    """Training can collapse a quantizer (the zoo's MobileNetV2 does): the resume takes it, and
    says so in one WARNING naming the layer."""
    import logging

    d, sd = trained
    bad = _edit(_edit(sd, "conv.act_quant.clip_max", lambda t: t.fill_(-100.0)), "conv.act_quant.clip_min",
                lambda t: t.fill_(5.0))
    with caplog.at_level(logging.WARNING, logger="openamct.checkpoint"):
        _restore(d, bad)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("collapsed activation quantizer" in w and "'conv.act_quant.clip_max' = -100" in w
               and "empty range" in w and "[conv]" in w for w in warnings), warnings


def test_raw_clips_that_crossed_in_training_still_restore(trained):
    """Training moves the raw parameters freely; the quantizer uses max(clip_max, 0) and
    min(clip_min, 0), so clip_min 3 above clip_max 2 is a state openamct itself produces
    (seen in the zoo's MobileNetV2 after two SGD steps) and must resume."""
    d, sd = trained
    crossed = _edit(_edit(sd, "conv.act_quant.clip_max", lambda t: t.fill_(2.0)), "conv.act_quant.clip_min",
                    lambda t: t.fill_(3.0))
    m = _restore(d, crossed, "crossed.pth")
    assert float(m.state_dict()["conv.act_quant.clip_min"]) == 3.0
