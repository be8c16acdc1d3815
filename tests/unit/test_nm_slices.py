"""2:4 masks computed, checked and kept a slice of rows at a time (``nm_apply.row_slices``):
the same bits as the whole-mask reference, in caller-owned workspace buffers too."""

import pytest
import torch
from torch import nn

from openamct.sparsity import nm_apply
from openamct.sparsity.nm import NMSparsifier, compute_nm_mask, nm_axis, nm_groups
from tests.unit.test_nm import _reference_mask


@pytest.mark.parametrize("shape,axis,groups", [((8, 6, 3, 3), 1, 1), ((12, 5, 3, 3), 0, 3), ((10, 8), 1, 1),
                                               ((6, 4, 2), 0, 2)])
@pytest.mark.parametrize("slice_elems", [1, 30, 1 << 20])
def test_pattern_check_of_packed_bits_in_row_slices(shape, axis, groups, slice_elems, monkeypatch):
    """check_nm_pattern reads the packed mask a slice of rows at a time (restore's memory on
    large models): it refuses what the whole-mask count refuses, with the same counts, wherever
    the excess lies (here: only in the last row)."""
    from openamct.record.mask_codec import pack_bits
    from openamct.techniques.sparsity24 import check_nm_pattern, excess_over_2_of_4

    monkeypatch.setattr(nm_apply, "_MASK_CHUNK_ELEMS", slice_elems)
    torch.manual_seed(0)
    good = compute_nm_mask(torch.randn(shape), axis, groups=groups, as_bool=True)
    check_nm_pattern(pack_bits(good), shape, axis, groups, "m")
    bad = good.clone()
    bad[-1] = True
    extra = excess_over_2_of_4(bad, axis, groups)
    assert extra > 0
    with pytest.raises(ValueError, match=rf"m is not a 2:4 mask: {extra} group\(s\) .* \({int(bad.sum())} of "):
        check_nm_pattern(pack_bits(bad), shape, axis, groups, "m")


@pytest.mark.parametrize(
    "layer",
    [nn.Linear(18, 10), nn.Linear(13, 10), nn.Conv2d(10, 6, 3), nn.ConvTranspose2d(12, 6, 3, groups=2),
     nn.ConvTranspose2d(16, 6, 3, groups=2), nn.ConvTranspose2d(22, 5, 3)],
    ids=["linear", "linear-rows-of-13-bits", "conv2d", "grouped-convtranspose-padded", "grouped-convtranspose",
         "convtranspose"],
)
def test_a_recompute_in_slices_gives_the_whole_mask_and_counts_one_change(layer, monkeypatch):

    monkeypatch.setattr(nm_apply, "_MASK_CHUNK_ELEMS", 16)  # several slices, the last one short
    torch.manual_seed(3)
    sp = NMSparsifier.from_module(layer, update_freq=1).train()
    w = layer.weight.detach()
    sp(w)
    ref = compute_nm_mask(w, nm_axis(layer), groups=nm_groups(layer), as_bool=True)
    assert torch.equal(sp.mask, ref)
    assert sp.version == 1
    w2 = torch.randn_like(w)
    sp(w2)
    assert torch.equal(sp.mask, compute_nm_mask(w2, nm_axis(layer), groups=nm_groups(layer), as_bool=True))
    assert sp.version == 2  # one recompute that changed bits in several slices: one change


def test_hf_conv1d_masks_are_computed_in_slices_along_its_input_axis(monkeypatch):
    """GPT-2's Conv1D stores [in, out]: 2:4 groups run down dim 0, which the slices cut."""

    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
    monkeypatch.setattr(nm_apply, "_MASK_CHUNK_ELEMS", 40)
    torch.manual_seed(4)
    layer = Conv1D(8, 22)  # weight [22, 8]: a row is a whole byte, and 40 elements are 5 rows
    sp = NMSparsifier.from_module(layer, update_freq=0).train()
    assert sp.axis == 0 and len(sp._pieces()[0]) > 2
    sp(layer.weight.detach())
    assert torch.equal(sp.mask, compute_nm_mask(layer.weight.detach(), 0, as_bool=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape,axis", [((6, 16), 1), ((16, 6), 0), ((4, 8, 3, 3), 1), ((8, 4, 2), 0)])
def test_a_recompute_in_workspace_buffers_matches_the_reference_on_hard_values(dtype, shape, axis, monkeypatch):
    """The recompute's 2:4 path (keep24_into, temporaries in reused buffers) against the plain
    reference, on ties, signed zeros, +-inf and NaN; twice in a row, so the second run reads
    buffers the first one filled."""
    from openamct.large.mask_bits import keep24_in_workspace, keep24_into
    from openamct.large.workspace import Workspace

    monkeypatch.setattr(nm_apply, "_MASK_CHUNK_ELEMS", 24)  # several slices through the same buffers
    gen = torch.Generator().manual_seed(sum(shape) + axis)
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, float("inf"), float("-inf"), float("nan"), 0.5, -2.0])
    ws = Workspace()
    for _ in range(2):
        w = vals[torch.randint(0, len(vals), shape, generator=gen)].to(dtype)
        sp = NMSparsifier(shape, axis, update_freq=0).train()
        sp.keep24 = keep24_in_workspace  # the branch point, as build sets it on a CPU model
        sp(w)
        flat = w.float().nan_to_num(nan=float("inf")).movedim(axis, -1).reshape(-1, shape[axis])
        ref = _reference_mask(flat, 2, 4).reshape(*w.movedim(axis, -1).shape).movedim(-1, axis)
        assert torch.equal(sp.mask, ref.bool())
        assert torch.equal(keep24_into(w, axis, ws), compute_nm_mask(w, axis, as_bool=True))
