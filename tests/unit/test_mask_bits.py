"""Masks at one bit per weight (record/mask_codec.py; the workspace unpack of large/mask_bits.py):
the record's bit order, slices that start anywhere, and writes that report whether a bit changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from openamct.large.mask_bits import unpack_rows_reused
from openamct.large.workspace import Workspace
from openamct.record.mask_codec import (
    pack_bits,
    pack_mask,
    packed_size,
    unpack_bits,
    unpack_mask,
    unpack_rows,
    words_of_bits,
    write_bits,
)


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 64, 65, 1000])
def test_bits_are_the_record_words_bytes(numel):
    torch.manual_seed(numel)
    keep = torch.rand(numel) < 0.5
    bits = pack_bits(keep)
    assert bits.dtype == torch.uint8 and bits.numel() == packed_size(numel) == -(-numel // 8)
    _, words = pack_mask(keep)
    assert words_of_bits(bits) == np.asarray(words, dtype="<i8").tobytes()  # the record's words, unpacked never
    assert torch.equal(unpack_mask([numel], words, torch.bool), keep)
    assert torch.equal(unpack_bits(bits, 0, numel), keep)


def test_unpacking_any_slice_gives_those_elements():
    torch.manual_seed(0)
    keep = torch.rand(203) < 0.3
    bits = pack_bits(keep)
    for start in (0, 1, 7, 8, 13, 100, 202):
        for count in (0, 1, 5, 8, 203 - start):
            if start + count <= 203:
                assert torch.equal(unpack_bits(bits, start, count), keep[start:start + count]), (start, count)


def test_rows_of_a_mask_whose_rows_do_not_fill_whole_bytes():
    torch.manual_seed(1)
    keep = torch.rand(11, 13) < 0.5
    bits = pack_bits(keep)
    for rows in (slice(0, 3), slice(3, 7), slice(10, 11), slice(0, 11)):
        assert torch.equal(unpack_rows(bits, keep.shape, rows), keep[rows])


@pytest.mark.parametrize("shape", [(11, 13), (64, 24), (5, 3, 7)])
def test_rows_unpacked_into_the_kept_buffer_match_numpys_unpacking(shape):
    torch.manual_seed(sum(shape))
    keep = torch.rand(shape) < 0.5
    bits = pack_bits(keep)
    for rows in (slice(0, 1), slice(1, 4), slice(2, shape[0]), slice(0, shape[0])):
        got = unpack_rows_reused(bits, keep.shape, rows, Workspace())
        assert got.dtype == torch.bool and torch.equal(got, keep[rows]), rows
        assert torch.equal(got, unpack_rows(bits, keep.shape, rows))


def test_a_write_packs_into_its_bytes_and_says_whether_a_bit_changed():
    torch.manual_seed(2)
    keep = torch.rand(40) < 0.5
    bits = pack_bits(keep)
    assert not bool(write_bits(bits, 16, keep[16:32]))
    flipped = ~keep[16:32]
    assert bool(write_bits(bits, 16, flipped))
    expect = keep.clone()
    expect[16:32] = flipped
    assert torch.equal(unpack_bits(bits, 0, 40), expect)
    with pytest.raises(ValueError, match="start: 3 is not a multiple of 8"):
        write_bits(bits, 3, keep[:8])


def test_float_masks_pack_by_nonzero():
    assert torch.equal(pack_bits(torch.tensor([1.0, 0.0, 1.0])), torch.tensor([0b10100000], dtype=torch.uint8))
