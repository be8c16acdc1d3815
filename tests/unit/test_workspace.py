"""Reused per-thread buffers (openamct/_workspace.py) and the hot loops that draw on them."""

from __future__ import annotations

import threading

import torch
from torch import nn

from openamct.large.workspace import Workspace


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


def test_a_mask_recompute_and_a_clip_search_allocate_their_temporaries_once(monkeypatch):
    """Two recomputes, two searches: the second of each runs in the first one's buffers."""
    import openamct.prune.nm as nm
    from openamct.prune.nm import NMSparsifier
    from openamct.quant import clip_init

    monkeypatch.setattr(nm, "_WS", Workspace())
    monkeypatch.setattr(clip_init, "_WS", Workspace())
    lin = nn.Linear(64, 32)
    sp = NMSparsifier.from_module(lin, update_freq=1).train()
    sp(lin.weight.detach())
    first = {k: t.data_ptr() for k, t in nm._WS.tensors.items()}
    assert first  # the 2:4 path ran in the workspace
    sp(torch.randn_like(lin.weight))
    assert {k: t.data_ptr() for k, t in nm._WS.tensors.items()} == first
    x = torch.randn(clip_init.MAX_SEARCH_ELEMS * 2 + 5)  # subsampled into the workspace too
    clip_init.search_clips(x, 3.0, -3.0, fixed_min=False)
    first = {k: t.data_ptr() for k, t in clip_init._WS.tensors.items()}
    assert {k[0] for k in first} == {"chunk", "sample"}
    clip_init.search_clips(x * 2, 6.0, -6.0, fixed_min=False)
    assert {k: t.data_ptr() for k, t in clip_init._WS.tensors.items()} == first
