"""Reused per-thread buffers (openamct/large/workspace.py) and the hot loops that draw on them."""

from __future__ import annotations

import threading

import torch
from torch import nn

from openamct.large.workspace import Workspace
from openamct.sparsity import nm_apply


def test_take_reuses_one_buffer_per_name_and_dtype_and_grows_it():
    ws = Workspace()
    a = ws.take("x", (4, 8), torch.float32, "cpu")
    assert a.shape == (4, 8)
    b = ws.take("x", (2, 3), torch.float32, "cpu")
    assert b.data_ptr() == a.data_ptr()  # smaller: the same memory
    c = ws.take("x", (2, 3), torch.bool, "cpu")
    d = ws.take("y", (2, 3), torch.float32, "cpu")
    assert len({a.data_ptr(), c.data_ptr(), d.data_ptr()}) == 3  # per dtype, per name
    e = ws.take("x", (100,), torch.float32, "cpu")
    assert e.numel() == 100 and ws.take("x", (32,), torch.float32, "cpu").data_ptr() == e.data_ptr()
    ws.release()
    assert not ws.tensors


def test_each_thread_has_its_own_buffers():
    ws = Workspace()
    mine = ws.take("x", (16,), torch.float32, "cpu").data_ptr()
    seen = []
    t = threading.Thread(target=lambda: seen.append(ws.take("x", (16,), torch.float32, "cpu").data_ptr()))
    t.start()
    t.join()
    assert seen and seen[0] != mine


def test_a_mask_recompute_runs_its_slices_in_one_workspace(monkeypatch):
    """A recompute of several slices computes each in the buffers of one workspace made for it
    (nm._keep_of's branch, ``NMSparsifier.keep24``), and a second recompute makes a new one (no module state)."""
    import openamct.sparsity.nm as nm
    from openamct.large import mask_bits
    from openamct.sparsity.nm import NMSparsifier

    seen = []
    real = mask_bits.keep24_into

    def spy(x, axis, ws):
        seen.append((id(ws), {k: t.data_ptr() for k, t in ws.tensors.items()}))
        return real(x, axis, ws)

    monkeypatch.setattr(mask_bits, "keep24_into", spy)
    monkeypatch.setattr(nm_apply, "_MASK_CHUNK_ELEMS", 64 * 8)  # several slices per recompute
    lin = nn.Linear(64, 32)
    sp = NMSparsifier.from_module(lin, update_freq=1).train()
    sp.keep24 = mask_bits.keep24_in_workspace  # the branch point, as build sets it on a CPU model
    sp(lin.weight.detach())
    assert len(seen) > 2 and len({ws for ws, _ in seen}) == 1
    assert seen[1][1] and all(ptrs == seen[1][1] for _, ptrs in seen[2:])  # no new buffer per slice
    assert torch.equal(sp.mask, nm.compute_nm_mask(lin.weight.detach(), 1, as_bool=True))
    seen.clear()
    sp(torch.randn_like(lin.weight))  # update_freq=1: recomputed, in a workspace of its own
    assert len(seen) > 2 and len({ws for ws, _ in seen}) == 1 and not seen[0][1]  # starts empty
