"""2:4 mask computation, the NMSparsifier module and the record mask codec."""

import pytest
import torch
from torch import nn

from openamct.record.mask_codec import pack_mask, unpack_mask
from openamct.sparsity.nm import NMSparsifier, compute_nm_mask, nm_axis, nm_eligible, nm_groups


def _groups_along(t: torch.Tensor, axis: int) -> torch.Tensor:
    """[..., 4] view of full groups of 4 along ``axis`` (axis size must be a multiple of 4)."""
    t = t.movedim(axis, -1)
    return t.reshape(*t.shape[:-1], t.shape[-1] // 4, 4)


@pytest.mark.parametrize(
    "layer",
    [nn.Conv2d(8, 6, 3), nn.Linear(16, 10), nn.ConvTranspose2d(12, 5, 3), nn.Conv2d(16, 8, 1, groups=2)],
    ids=["conv2d", "linear", "convtranspose2d", "groupconv"],
)
def test_two_of_four_along_input_axis(layer):
    torch.manual_seed(0)
    w = layer.weight.detach()
    axis = nm_axis(layer)
    mask = compute_nm_mask(w, axis)
    assert mask.shape == w.shape and mask.dtype == w.dtype
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    groups = _groups_along(mask, axis)
    assert bool((groups.sum(-1) == 2).all())
    assert mask.mean().item() == 0.5
    # The kept two are the two largest magnitudes of each group.
    mags = _groups_along(w.abs(), axis)
    kept_min = torch.where(groups.bool(), mags, torch.inf).min(-1).values
    dropped_max = torch.where(groups.bool(), -torch.inf, mags).max(-1).values
    assert bool((kept_min >= dropped_max).all())


def test_axis_is_input_channels_not_output():
    # Row 0 of a Linear weight: big values on input channels 0 and 3 -> keep those two.
    w = torch.tensor([[9.0, 1.0, 2.0, 8.0], [1.0, 2.0, 3.0, 4.0]])
    assert compute_nm_mask(w, 1).tolist() == [[1, 0, 0, 1], [0, 0, 1, 1]]
    # Conv2d: group = 4 consecutive input channels at the same (out, kh, kw).
    conv = torch.zeros(1, 4, 1, 2)
    conv[0, :, 0, 0] = torch.tensor([1.0, 5.0, 4.0, 2.0])
    conv[0, :, 0, 1] = torch.tensor([7.0, 1.0, 1.5, 6.0])
    mask = compute_nm_mask(conv, 1)
    assert mask[0, :, 0, 0].tolist() == [0, 1, 1, 0]
    assert mask[0, :, 0, 1].tolist() == [1, 0, 0, 1]


def _reference_mask(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Row-wise (axis -1) reference: pad with -1, keep the n largest, ties to the lower index."""
    rows = w.abs().reshape(-1, w.shape[-1]).tolist()
    out = []
    for row in rows:
        padded = row + [-1.0] * (-len(row) % m)
        kept = []
        for g in range(0, len(padded), m):
            order = sorted(range(m), key=lambda i: (-padded[g + i], i))[:n]
            kept += [1.0 if i in order else 0.0 for i in range(m)]
        out.append(kept[: len(row)])
    return torch.tensor(out).reshape(w.shape)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 4), (4, 8)])
@pytest.mark.parametrize("cin", [4, 5, 7, 12])
def test_matches_reference_with_ties(n, m, cin):
    gen = torch.Generator().manual_seed(cin * 10 + m)
    w = torch.randint(-3, 4, (9, cin), generator=gen).float()  # many equal magnitudes
    got = compute_nm_mask(w, 1, n, m)
    assert torch.equal(got, _reference_mask(w, n, m))
    # Same answer through a conv layout (axis 1 of [out, cin, kh, kw]).
    conv = w.reshape(3, 3, cin).permute(0, 2, 1).unsqueeze(-1).contiguous()
    expect = got.reshape(3, 3, cin).permute(0, 2, 1).unsqueeze(-1)
    assert torch.equal(compute_nm_mask(conv, 1, n, m), expect)


def test_nm_axis_kinds():
    assert nm_axis(nn.Conv2d(4, 4, 1)) == 1
    assert nm_axis(nn.Linear(4, 4)) == 1
    assert nm_axis(nn.Conv1d) == 1 and nm_axis("Conv3d") == 1
    assert nm_axis(nn.ConvTranspose2d(4, 4, 1)) == 0 and nm_axis("ConvTranspose1d") == 0
    with pytest.raises(ValueError, match="BatchNorm2d"):
        nm_axis(nn.BatchNorm2d(4))
    with pytest.raises(TypeError, match="module_or_kind"):
        nm_axis(3)


def test_padding_rule_cin6_and_cin3():
    # Cin = 6: group [0..3] keeps 2, trailing group of 2 real + 2 padding keeps both real ones.
    w6 = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.1, 0.2]])
    assert compute_nm_mask(w6, 1).tolist() == [[0, 1, 1, 0, 1, 1]]
    # Even an exact zero beats padding.
    assert compute_nm_mask(torch.tensor([[0.0, 0.0, 0.0]]), 1).tolist() == [[1, 1, 0]]
    w3 = torch.tensor([[0.5, -3.0, 2.0]])
    assert compute_nm_mask(w3, 1).tolist() == [[0, 1, 1]]
    # Same rule on a conv input axis: 6 input channels keep 4 at every (out, kh, kw).
    m = compute_nm_mask(torch.randn(5, 6, 3, 3), 1)
    assert bool((m.sum(1) == 4).all())


def test_ties_keep_lower_index_and_grouped_transpose():
    assert compute_nm_mask(torch.ones(2, 8), 1).tolist() == [[1, 1, 0, 0] * 2] * 2
    # NaN ranks as the largest magnitude and the group still keeps exactly two.
    nan = float("nan")
    assert compute_nm_mask(torch.tensor([[0.1, nan, 3.0, nan]]), 1).tolist() == [[0, 1, 0, 1]]
    half = compute_nm_mask(torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float16), 1)
    assert half.dtype == torch.float16 and half.tolist() == [[0, 0, 1, 1]]
    # ConvTranspose2d groups=2 with 6 input channels per group: each conv group padded alone.
    t = nn.ConvTranspose2d(12, 4, 3, groups=2)
    assert nm_groups(t) == 2
    mask = compute_nm_mask(torch.ones_like(t.weight), 0, groups=nm_groups(t))
    assert mask[:, 0, 0, 0].tolist() == [1, 1, 0, 0, 1, 1] * 2


def test_eligibility():
    assert nm_eligible(nn.Conv2d(8, 8, 3)) == (True, "")
    assert nm_eligible(nn.Linear(3, 2))[0]
    assert nm_eligible(nn.ConvTranspose2d(4, 4, 2))[0]
    ok, reason = nm_eligible(nn.Conv2d(16, 16, 3, groups=16))
    assert not ok and "depthwise" in reason
    ok, reason = nm_eligible(nn.Conv2d(8, 8, 3, groups=4))  # 2 input channels per group
    assert not ok and "2 input channel" in reason
    assert not nm_eligible(nn.Linear(2, 8))[0]
    assert not nm_eligible(nn.ConvTranspose2d(8, 8, 3, groups=8))[0]
    ok, reason = nm_eligible(nn.Conv1d(8, 8, 3))
    assert not ok and "Conv1d" in reason
    with pytest.raises(ValueError, match="depthwise"):
        NMSparsifier.from_module(nn.Conv2d(16, 16, 3, groups=16), 0)


def _train(layer: nn.Linear, sparsifier: NMSparsifier, steps: int, lr: float = 0.5):
    """Train so magnitudes reorder: target pushes the initially smallest weights up."""
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    masks = []
    for _ in range(steps):
        w = sparsifier(layer.weight)
        loss = -(w * layer.weight.detach().abs().argsort(1).argsort(1).lt(2)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        masks.append(sparsifier.mask.clone())
    return masks


def _sign_fixed_layer(seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(4, 8) + 0.1)  # positive, so pushing up grows |w|
    return layer


def test_update_freq_zero_keeps_first_mask():
    layer = _sign_fixed_layer()
    sp = NMSparsifier(layer.weight.shape, 1, update_freq=0).train()
    first = compute_nm_mask(layer.weight.detach(), 1)
    masks = _train(layer, sp, steps=6)
    assert all(torch.equal(m, first) for m in masks)
    # The weights did move enough that a recompute would give a different mask.
    assert not torch.equal(compute_nm_mask(layer.weight.detach(), 1), first)
    assert sp.state_dict()["step"].item() == 6 and bool(sp.mask_ready)
    assert sp.version == 1


def test_update_freq_one_follows_weights():
    layer = _sign_fixed_layer()
    sp = NMSparsifier(layer.weight.shape, 1, update_freq=1).train()
    first = compute_nm_mask(layer.weight.detach(), 1)
    prev_weights = []
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    for _ in range(4):
        prev_weights.append(layer.weight.detach().clone())
        w = sp(layer.weight)
        # Each forward's mask is the mask of the weights it saw.
        assert torch.equal(sp.mask, compute_nm_mask(prev_weights[-1], 1))
        loss = -(w * layer.weight.detach().abs().argsort(1).argsort(1).lt(2)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not torch.equal(sp.mask, first)
    assert sp.version >= 2


def test_update_freq_three_recomputes_on_schedule():
    sp = NMSparsifier((2, 4), 1, update_freq=3).train()
    w = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 2)
    recomputed = []
    for i in range(7):
        w = w.flip(1) if i else w  # reorder magnitudes every step
        before = sp.mask.clone()
        sp(w)
        recomputed.append(not torch.equal(before, sp.mask))
    assert recomputed == [True, False, False, True, False, False, True]


def test_version_counts_only_real_mask_changes():
    sp = NMSparsifier((2, 4), 1, update_freq=1).train()
    w = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 2)
    for _ in range(3):
        sp(w)  # recomputed every forward, identical every time
    assert sp.version == 1
    sp(w.flip(1))
    assert sp.version == 2


def test_eval_never_changes_ready_mask_but_computes_unready():
    sp = NMSparsifier((1, 4), 1, update_freq=1).eval()
    out = sp(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert out.tolist() == [[0, 0, 3, 4]] and bool(sp.mask_ready)
    out = sp(torch.tensor([[4.0, 3.0, 2.0, 1.0]]))
    assert out.tolist() == [[0, 0, 2, 1]] and sp.state_dict()["step"].item() == 0


def test_gradients_reach_masked_weights():
    layer = nn.Linear(8, 3)
    sp = NMSparsifier.from_module(layer, 0).train()
    x = torch.randn(5, 8)
    y = nn.functional.linear(x, sp(layer.weight), layer.bias)
    y.sum().backward()
    expected = x.sum(0).expand(3, 8)  # d/dW of sum(x W^T), unmasked
    assert (sp.mask == 0).sum() == 12
    torch.testing.assert_close(layer.weight.grad, expected)
    # Forward value is the masked product.
    torch.testing.assert_close(y, nn.functional.linear(x, layer.weight * sp.mask, layer.bias))


def test_state_dict_round_trip_and_set_mask():
    layer = nn.Conv2d(8, 4, 3)
    parent = nn.ModuleDict({"sp": NMSparsifier.from_module(layer, 2)}).train()
    for _ in range(3):
        parent["sp"](layer.weight + torch.randn_like(layer.weight))
    sd = parent.state_dict()
    assert set(sd) == {"sp.mask_bits", "sp.mask_ready", "sp.step"}
    # packed: a bit per weight, not a float copy of the weight nor a byte (large models)
    assert sd["sp.mask_bits"].dtype == torch.uint8 and sd["sp.mask_bits"].shape == (layer.weight.numel() // 8,)
    assert sd["sp.step"].dtype == torch.int64
    fresh = nn.ModuleDict({"sp": NMSparsifier.from_module(layer, 2)}).train()
    fresh.load_state_dict(sd)
    assert torch.equal(fresh["sp"].mask, parent["sp"].mask) and fresh["sp"].version == 1
    assert not parent["sp"].mask.all() and parent["sp"].mask.dtype == torch.bool
    for old_dtype in (torch.float32, torch.bool):  # float masks before masks were packed, then bool
        older = nn.ModuleDict({"sp": NMSparsifier.from_module(layer, 2)}).train()
        unpacked = {k: v for k, v in sd.items() if k != "sp.mask_bits"} | {"sp.mask": parent["sp"].mask.to(old_dtype)}
        older.load_state_dict(unpacked)
        assert torch.equal(older["sp"].mask_bits, parent["sp"].mask_bits) and older["sp"].version == 1
    # Host-side schedule resumes: step 3 -> forward at step 3 is not a multiple of 2.
    before = fresh["sp"].mask.clone()
    fresh["sp"](layer.weight.detach() * 0 + torch.arange(8.0).view(1, 8, 1, 1))
    assert torch.equal(fresh["sp"].mask, before) and fresh["sp"].state_dict()["step"].item() == 4
    sp = NMSparsifier((4, 8), 1, 0)
    with pytest.raises(ValueError, match=r"\[4, 4\].*\[4, 8\]"):
        sp.set_mask(torch.ones(4, 4))
    with pytest.raises(ValueError, match="0 or 1"):
        sp.set_mask(torch.full((4, 8), 0.5))
    recorded = compute_nm_mask(torch.randn(4, 8), 1)
    sp.set_mask(recorded)
    assert bool(sp.mask_ready) and sp.version == 1
    sp.train()(torch.randn(4, 8))  # ready: first training forward keeps the recorded mask
    assert torch.equal(sp.mask, recorded)


@pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export")
def test_eval_export_is_a_plain_masked_weight(tmp_path):
    ort = pytest.importorskip("onnxruntime")

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.sp = NMSparsifier.from_module(self.fc, 0)

        def forward(self, x):
            return nn.functional.linear(x, self.sp(self.fc.weight), self.fc.bias)

    model = Wrapped()
    model.train()(torch.randn(2, 8))
    model.eval()
    x = torch.randn(3, 8)
    path = tmp_path / "nm.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=["x"])
    got = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]
    expect = nn.functional.linear(x, model.fc.weight * model.sp.mask, model.fc.bias)
    assert (model.sp.mask == 0).sum() == 16
    torch.testing.assert_close(torch.from_numpy(got), expect.detach(), rtol=1e-5, atol=1e-6)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="update_freq"):
        NMSparsifier((4, 8), 1, -1)
    with pytest.raises(TypeError, match="update_freq"):
        NMSparsifier((4, 8), 1, 1.5)
    with pytest.raises(ValueError, match="axis"):
        NMSparsifier((4, 8), 2, 0)
    with pytest.raises(ValueError, match="w: shape"):
        NMSparsifier((4, 8), 1, 0)(torch.randn(8, 4))


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 127, 128, 1000, 4099])
def test_pack_unpack_round_trip(numel):
    gen = torch.Generator().manual_seed(numel)
    mask = (torch.rand(numel, generator=gen) > 0.5).float()
    shape = [numel] if numel % 3 else [3, numel // 3]
    mask = mask.view(shape)
    got_shape, words = pack_mask(mask)
    assert got_shape == shape and len(words) == -(-numel // 64)
    assert all(-(2**63) <= w < 2**63 for w in words)
    assert torch.equal(unpack_mask(got_shape, words), mask)
    assert pack_mask(mask.bool()) == (shape, words) == pack_mask(mask.numpy())


def test_pack_layout_and_errors():
    mask = torch.zeros(70)
    mask[[0, 2, 63, 64, 69]] = 1
    shape, words = pack_mask(mask)
    assert shape == [70]
    # upstream layout: element 8j+i is bit (7 - i) of byte j, bytes little-endian in the word
    assert words == [2**7 + 2**5 + 2**56, 2**7 + 2**2]
    top = torch.zeros(64)
    top[56] = 1  # most significant bit of the last byte -> negative two's complement
    assert pack_mask(top)[1] == [-(2**63)]
    real = compute_nm_mask(torch.randn(6, 10, 3, 3), 1)
    assert torch.equal(unpack_mask(*pack_mask(real)), real)
    with pytest.raises(ValueError, match="2 int64 words do not fit mask shape \\[10\\]"):
        unpack_mask([10], [1, 2])
    with pytest.raises(ValueError, match="int64 range"):
        unpack_mask([64], [2**63])
    with pytest.raises(ValueError, match="bits set past element 3"):
        unpack_mask([3], [8])
    with pytest.raises(ValueError, match="0 or 1"):
        pack_mask(torch.tensor([0.0, 2.0]))


@pytest.mark.parametrize("shape,axis,groups", [((8, 6, 3, 3), 1, 1), ((12, 5, 3, 3), 0, 3), ((10, 7), 1, 1),
                                               ((6, 4, 2), 0, 2)])
def test_pattern_check_counts_what_recomputing_the_mask_would_drop(shape, axis, groups):
    """check_nm_pattern counts kept weights beyond 2 per group of 4 (recomputing a mask from
    the mask was most of restore's time); the count equals what the recompute drops."""
    from openamct.techniques.sparsity24 import excess_over_2_of_4

    torch.manual_seed(0)
    for p in (0.3, 0.5, 0.8, 1.0):
        keep = torch.rand(shape) < p
        allowed = compute_nm_mask(keep.float(), axis, 2, 4, groups=groups, as_bool=True)
        assert excess_over_2_of_4(keep, axis, groups) == int((keep & ~allowed).sum())
    assert excess_over_2_of_4(compute_nm_mask(torch.randn(shape), axis, groups=groups, as_bool=True), axis, groups) == 0


def test_an_n_of_m_sparsifier_keeps_n_of_every_m_and_never_takes_the_2_4_path():
    """NMSparsifier is not hard-wired to 2:4: 4:8 and 1:4 masks keep n of every m along the
    input axis, and the large path's 2:4 keep-flags function (``keep24``) is taken for 2:4 only."""
    torch.manual_seed(0)
    w = torch.randn(6, 16)

    def refuse(axis):
        raise AssertionError("the 2:4 path was taken for another pattern")

    for n, m in ((4, 8), (1, 4)):
        sp = NMSparsifier(tuple(w.shape), 1, 0, n=n, m=m).train()
        sp.keep24 = refuse
        out = sp(w)
        kept = (out != 0).view(6, 16 // m, m).sum(-1)
        assert torch.equal(kept, torch.full_like(kept, n)), (n, m)
        assert torch.equal(sp.mask, compute_nm_mask(w, 1, n, m, as_bool=True))
    calls = []
    sp24 = NMSparsifier(tuple(w.shape), 1, 0).train()
    sp24.keep24 = lambda axis: calls.append(axis) or (lambda x: compute_nm_mask(x, axis, as_bool=True))
    sp24(w)
    assert calls == [1]
