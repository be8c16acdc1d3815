"""Embedding tables reuse the memory of the last step's freed ``.grad`` for their weight gradient
(``large/embedding_grad.py``): torch's gradient bit for bit, never a buffer someone holds."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from openamct.large.embedding_grad import PooledGradEmbedding, pool_embedding_grads
from openamct.large.runtime import LargeRuntime

RT = LargeRuntime()  # the pooled tables' buffers (a model's keeper owns one)


@pytest.fixture(autouse=True)
def _empty_pool():
    RT.release()
    yield
    RT.release()


class _Net(nn.Module):
    def __init__(self, padding_idx=None, tied=False):
        super().__init__()
        self.emb = nn.Embedding(50, 6, padding_idx=padding_idx)
        self.head = nn.Linear(6, 50, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def _ids(seed, dtype=torch.int64):
    # Repeated ids (each row's gradient is a sum, whose order matters for the bits) and every
    # padding candidate; values spread over 16 orders of magnitude make any reordering show.
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, 8, (3, 40), generator=g), torch.zeros(3, 1, dtype=torch.int64)], 1).to(dtype)


def _dy(seed):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(3, 41, 50, generator=g) * torch.logspace(-8, 8, 41)[None, :, None]


def _pair(**kw):
    torch.manual_seed(0)
    ref = _Net(**kw)
    ours = copy.deepcopy(ref)
    return ref, ours, pool_embedding_grads(ours, RT)


@pytest.mark.parametrize("padding_idx", [None, 0, 5])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_the_gradient_is_torchs_bit_for_bit_and_reuses_the_last_steps_memory(padding_idx, dtype):
    ref, ours, pooled = _pair(padding_idx=padding_idx)
    assert pooled == ["emb"] and type(ours.emb) is PooledGradEmbedding and isinstance(ours.emb, nn.Embedding)
    assert list(ours.state_dict()) == list(ref.state_dict())
    addresses = []
    for step in range(3):
        for m in (ref, ours):
            m.emb.weight.grad = None  # zero_grad(set_to_none=True)
            y = m(_ids(step, dtype))
            y.backward(_dy(step))
        assert torch.equal(ours(_ids(step, dtype)), ref(_ids(step, dtype)))
        assert torch.equal(ours.emb.weight.grad, ref.emb.weight.grad)
        if padding_idx is not None:
            assert not ours.emb.weight.grad[padding_idx].any()
        addresses.append(ours.emb.weight.grad.data_ptr())
        blocker = torch.empty_like(ours.emb.weight)  # would take the freed block if the pool had not kept it
    assert addresses[0] == addresses[1] == addresses[2] != blocker.data_ptr()


def test_a_kept_gradient_is_never_overwritten_and_accumulation_adds_as_torch_does():
    ref, ours, _ = _pair()
    for m in (ref, ours):
        m(_ids(0)).backward(_dy(0))
    kept = ours.emb.weight.grad
    before = kept.clone()
    ours.emb.weight.grad = None
    ours(_ids(1)).backward(_dy(1))
    assert ours.emb.weight.grad.data_ptr() != kept.data_ptr() and torch.equal(kept, before)
    # A .grad kept across steps (set_to_none=False, accumulation): the new gradient is added in.
    ours.emb.weight.grad = before.clone()
    ours(_ids(1)).backward(_dy(1))
    ref(_ids(1)).backward(_dy(1))
    assert torch.equal(ours.emb.weight.grad, ref.emb.weight.grad)


def test_a_second_backward_through_a_retained_graph_gives_the_same_gradient():
    ref, ours, _ = _pair()
    for m in (ref, ours):
        y = m(_ids(2))
        y.backward(_dy(2), retain_graph=True)
        first = m.emb.weight.grad.clone()
        m.emb.weight.grad = None
        y.backward(_dy(2))
        assert torch.equal(m.emb.weight.grad, first)
    assert torch.equal(ours.emb.weight.grad, ref.emb.weight.grad)


def test_tables_that_are_shared_subclassed_or_renormalised_stay_as_they_are():
    _, tied, pooled = _pair(tied=True)
    assert pooled == [] and type(tied.emb) is nn.Embedding

    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    twice = nn.Module()
    twice.a = twice.b = nn.Embedding(4, 2)  # one table under two names
    model = nn.ModuleDict({"scaled": Scaled(4, 2), "max_norm": nn.Embedding(4, 2, max_norm=1.0), "twice": twice})
    assert pool_embedding_grads(model, RT) == []


def test_without_a_gradient_wanted_or_with_sparse_set_later_the_plain_forward_runs():
    _, ours, _ = _pair()
    with torch.no_grad():
        y = ours(_ids(0))
    assert y.grad_fn is None
    ours.emb.sparse = True  # changed after the swap: torch's sparse gradient, as before
    ours(_ids(0)).backward(_dy(0))
    assert ours.emb.weight.grad.is_sparse


def test_eval_gives_the_buffer_back():
    _, ours, _ = _pair()
    ours(_ids(0)).backward(_dy(0))
    ours.emb.weight.grad = None
    assert len(RT.grads) == 1
    ours.eval()
    assert len(RT.grads) == 0


def _table_pair(rows, dim):
    torch.manual_seed(0)
    ref = nn.Embedding(rows, dim)
    ours = copy.deepcopy(ref)
    ours.__class__ = PooledGradEmbedding
    ours.large = RT
    return ref, ours


def test_rows_the_last_step_wrote_are_zeroed_again_and_a_changed_gradient_is_zeroed_whole():
    """Only the last step's rows are zeroed before a reused buffer is added into: rows of an
    earlier step must not survive, and a caller's in-place change to ``.grad`` (version bumped)
    means any row may hold something."""
    ref, ours = _table_pair(1000, 16)
    steps = [torch.tensor([1, 2, 3, 2]), torch.tensor([[7, 8]]), torch.tensor([500]), torch.tensor([9])]
    for step, ids in enumerate(steps):
        for m in (ref, ours):
            m.weight.grad = None
            m(ids).backward(torch.full((*ids.shape, 16), float(step + 1)))
        assert torch.equal(ours.weight.grad, ref.weight.grad), step
        if step == 1:
            ours.weight.grad.add_(0.5)  # e.g. noise or a penalty added in place, then dropped


def test_a_large_tables_gradient_maps_only_the_rows_its_steps_write():
    """A step looks up a few rows of a large table: its gradient buffer is neither zero-filled
    whole when new nor again at each step (a 131 MB fill in a 250M Llama's first step)."""
    import os
    import resource

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    ref, ours = _table_pair(32768, 512)  # 64 MB of gradient
    page = os.sysconf("SC_PAGE_SIZE")
    mapped = 0
    for step in range(3):
        ids = torch.randint(0, 32768, (8,), generator=torch.Generator().manual_seed(step))
        for m in (ref, ours):
            m.weight.grad = None
        ref(ids).sum().backward()
        y = ours(ids).sum()
        before = faults()
        y.backward()
        mapped += (faults() - before) * page
        assert torch.equal(ours.weight.grad, ref.weight.grad)
    assert mapped < 8 << 20, f"{mapped / 2**20:.1f} MB mapped for 24 rows of 2 KB"
