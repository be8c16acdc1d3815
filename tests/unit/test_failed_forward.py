"""A forward that raises leaves no trace: the quantizers are not initialised
from that batch and the 2:4 step counters do not advance."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import openamct as amct
from tests.small import INT8, ConvFc, changed_keys, snapshot, write_cfg

CFG = INT8 + "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 1 } } }\n"


class Net(ConvFc):
    """ConvFc (8 -> 16 -> 4) that flattens instead of averaging: it needs a 1x1 spatial input."""

    def __init__(self):
        super().__init__(c_in=8, width=16, outputs=4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _created(tmp_path):
    """A 1x1 batch and the model created from it under CFG, in training mode."""
    x = torch.randn(2, 8, 1, 1)
    m = amct.create_compressed_retrain_model(Net(), x, write_cfg(tmp_path, CFG, "c.cfg"), str(tmp_path / "r.txt"))
    m.train()
    return m, x


def test_a_failed_forward_initialises_nothing_and_counts_no_step(tmp_path):
    m, x = _created(tmp_path)
    before = snapshot(m)
    huge = torch.randn(2, 8, 4, 4) * 1000  # conv runs, fc fails on the shape
    with pytest.raises(RuntimeError):
        m(huge)
    changed = changed_keys(before, m)
    assert changed == [], changed
    assert not bool(m.conv.act_quant.initialized) and int(m.conv.sparsity.state_dict()["step"]) == 0
    m(x)  # the next good batch initialises from itself
    assert bool(m.conv.act_quant.initialized) and int(m.conv.sparsity.state_dict()["step"]) == 1
    assert m.conv.act_quant.clip_max.item() < 50


def test_a_failed_forward_is_also_undone_by_the_next_forward(tmp_path):
    m, x = _created(tmp_path)
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 8, 4, 4) * 1000)
    m(x)
    assert int(m.conv.sparsity.state_dict()["step"]) == 1 and m.conv.act_quant.clip_max.item() < 50


def test_a_mask_not_computed_yet_is_put_back_without_a_copy(tmp_path):
    """The first forward's snapshot keeps no copy of the all-kept masks it is due to compute
    (at 1.1B parameters 130 MB of new pages in the first step), and still puts them back."""
    from openamct.training import rollback

    m, x = _created(tmp_path)
    kept = m.conv.sparsity.mask_bits.clone()
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 8, 4, 4) * 1000)  # the conv computes its mask, then fc fails
    masks = [state[2][-1] for sp, state in m._openamct._snapshot.items if sp is m.conv.sparsity]
    assert masks == [rollback._ALL_KEPT]
    m._openamct.undo_failed_forward()
    assert torch.equal(m.conv.sparsity.mask_bits, kept) and not m.conv.sparsity._ready


def test_a_mask_not_computed_but_not_all_kept_is_copied_and_put_back(tmp_path):
    m, x = _created(tmp_path)
    sp = m.conv.sparsity
    sp.mask_bits[3] = 0x5A  # as a checkpoint saved with mask_ready False could hold
    odd = sp.mask_bits.clone()
    assert not sp.holds_all_kept()
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 8, 4, 4) * 1000)
    assert not torch.equal(sp.mask_bits, odd)  # the failed forward computed a mask
    m._openamct.undo_failed_forward()
    assert torch.equal(sp.mask_bits, odd)


@pytest.mark.parametrize("shape", [(3, 4), (4, 8), (1, 4)])
def test_all_kept_is_recognised_and_rewritten_with_a_partial_last_byte(shape):
    from openamct.sparsity.nm import NMSparsifier

    sp = NMSparsifier(shape, 1, 0)
    start = sp.mask_bits.clone()
    assert sp.holds_all_kept()
    sp.mask_bits[-1] = 0xFF if start[-1] != 0xFF else 0x7F  # a different last byte
    assert not sp.holds_all_kept()
    sp.mask_bits.zero_()
    sp.reset_all_kept()
    assert torch.equal(sp.mask_bits, start) and sp.holds_all_kept()


SE_CFG = ("batch_num: 2\nretrain_data_quant_config { ulq_quantize { } }\n"
          "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n")


class SEResNet(nn.Module):
    """A ReLU that a conv and a residual Add both read (an output hook), a SiLU, a squeeze-excite
    gate (Sigmoid, multiply) and a conv whose output only the Add reads (an output quantizer).
    Raises at the very end of a forward when ``fail`` is set: every quantizer has run."""

    def __init__(self, c: int = 8) -> None:
        from tests.se_model import SqueezeExcite

        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.act = nn.ReLU()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.silu = nn.SiLU()
        self.se = SqueezeExcite(c, 4)
        self.proj = nn.Conv2d(c, c, 1, bias=False)
        self.head = nn.Conv2d(c, 4, 1, bias=False)
        self.fail = False

    def forward(self, x):
        r = self.act(self.stem(x))
        out = self.head(r + self.proj(self.se(self.silu(self.bn(self.conv(r))))))
        if self.fail:
            raise RuntimeError("forward failed after the quantizers ran")
        return out


def _quantizer_state(model):
    """Every tensor and init-batch input of every ActULQ the model runs: the layers' input and
    output quantizers, the SiLU/Sigmoid wrappers' q_in/q_inner/q_out, the residual hooks'."""
    from openamct.quant.activation import QuantizedActivation
    from openamct.quant.quantizers import ActULQ
    from openamct.quant.residual import output_hooks

    found = {n: m for n, m in model.named_modules() if isinstance(m, ActULQ)}
    found.update({f"{n} hook": h.quantizer for n, h in output_hooks(model)})
    wrappers = [m for m in model.modules() if isinstance(m, QuantizedActivation)]
    assert wrappers and output_hooks(model) and any(w.kind == "silu" for w in wrappers) \
        and any(w.kind == "sigmoid" for w in wrappers)
    assert any(getattr(m, "out_quant", None) is not None for m in model.modules())
    return {n: ({k: v.detach().clone() for k, v in q.state_dict().items()}, q._init_last_input)
            for n, q in found.items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for n in a:
        (ta, la), (tb, lb) = a[n], b[n]
        assert all(torch.equal(ta[k], tb[k]) for k in ta), (n, {k: (ta[k], tb[k]) for k in ta
                                                                if not torch.equal(ta[k], tb[k])})
        assert la is lb, n


def test_a_failed_forward_puts_back_every_quantizer_of_activations_outputs_and_residual_adds(tmp_path):
    """SiLU, Sigmoid (SE gate) and a residual Add in INT8 with batch_num 2: a forward that raises
    after the first batch leaves every quantizer as the first batch left it, and the second good
    batch initialises exactly as in a twin that never saw the failed one."""
    (tmp_path / "c.cfg").write_text(SE_CFG)
    g = torch.Generator().manual_seed(1)
    x1, x2, bad = torch.randn(4, 1, 28, 28, generator=g), torch.randn(4, 1, 28, 28, generator=g), \
        torch.randn(4, 1, 28, 28, generator=g) * 100
    torch.manual_seed(0)
    model = SEResNet().eval()
    made = [amct.create_compressed_retrain_model(model, x1, str(tmp_path / "c.cfg"),
                                                 str(tmp_path / f"r{i}.txt")) for i in range(2)]
    for m in made:
        m.train()
        m(x1)
    m, twin = made
    before = _quantizer_state(m)
    assert any(int(t["init_batches"]) == 1 and not bool(t["initialized"]) for t, _ in before.values())
    whole = snapshot(m)
    m.fail = True
    with pytest.raises(RuntimeError, match="quantizers ran"):
        m(bad)
    m.fail = False
    m._openamct.undo_failed_forward()  # what the next forward, state_dict() or save do first
    _same(_quantizer_state(m), before)
    assert changed_keys(whole, m) == []
    m(x2)
    twin(x2)
    _same(_quantizer_state(m), _quantizer_state(twin))
    assert all(bool(t["initialized"]) for t, _ in _quantizer_state(m).values())


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_a_clip_a_diverged_step_made_nan_is_named(tmp_path, train):
    """An optimizer step with NaN gradients leaves NaN clips: the next forward says which layer's
    quantizer, not a float-to-int conversion error from deep inside."""
    m, x = _created(tmp_path)
    m(x)  # initialises the clips
    with torch.no_grad():
        m.conv.act_quant.clip_max.fill_(float("nan"))
    m.train(train)
    # Training: the bad-value guard stops the step at the NaN outputs and names the clips;
    # eval: the record the forward writes cannot hold them.
    said = r"layer 'conv': its activation clips \(act_quant.clip_max\) hold NaN" if train else \
        r"^conv: activation clips are not finite \(clip_max nan"
    with pytest.raises(ValueError, match=said):
        m(x)
