"""A compressed Linear's backward writes the weight gradient where the last step's freed
``.grad`` was (``large/grad_pool.py``), and only where no one else still uses that memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from openamct.large import grad_pool
from openamct.large.fused_linear import masked_quant_linear
from tests.unit.test_fused_linear import RT, _case


@pytest.fixture(autouse=True)
def _empty_pool():
    RT.release()
    yield
    RT.release()


def _weight(transposed=False):
    x, w, _, mask, dy = _case((2, 9, 64), transposed, False, True)
    return x.detach(), nn.Parameter(w.detach().clone()), mask, dy


def _backward(x, w, mask, dy, transposed=False):
    y, _ = masked_quant_linear(x, w, None, mask, True, transposed, RT)
    y.backward(dy)


def _expected(x, dy, transposed=False):
    x2, g2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return x2.t().mm(g2) if transposed else g2.t().mm(x2)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_step_after_set_to_none_writes_the_gradient_into_the_last_steps_memory(transposed):
    x, w, mask, dy = _weight(transposed)
    _backward(x, w, mask, dy, transposed)
    first = w.grad.data_ptr()
    assert torch.equal(w.grad, _expected(x, dy, transposed))  # the same product, bit for bit
    w.grad = None  # zero_grad(set_to_none=True)
    blocker = torch.empty_like(w)  # would take the freed block if the pool had not kept it
    _backward(x, w, mask, 2 * dy, transposed)
    assert w.grad.data_ptr() == first != blocker.data_ptr()
    assert torch.equal(w.grad, _expected(x, 2 * dy, transposed))


def test_a_gradient_the_caller_kept_is_never_overwritten():
    x, w, mask, dy = _weight()
    _backward(x, w, mask, dy)
    kept = w.grad
    before = kept.clone()
    w.grad = None
    _backward(x, w, mask, 3 * dy)
    assert w.grad.data_ptr() != kept.data_ptr()
    assert torch.equal(kept, before)
    view = w.grad[1:]  # a view holds the memory as well
    before = view.clone()
    w.grad = None
    _backward(x, w, mask, dy)
    assert torch.equal(view, before)


def test_accumulation_into_an_existing_grad_adds_and_holds_no_second_buffer():
    x, w, mask, dy = _weight()
    _backward(x, w, mask, dy)
    _backward(x, w, mask, dy)  # gradient accumulation: autograd adds a temporary into .grad
    assert torch.equal(w.grad, 2 * _expected(x, dy))
    assert len(RT.grads) == 1  # only the buffer that is .grad itself
    assert RT.grads._held[w].data_ptr() == w.grad.data_ptr()
    w.grad.zero_()  # zero_grad(set_to_none=False): .grad stays, each step's temporary is added
    _backward(x, w, mask, dy)
    assert torch.equal(w.grad, _expected(x, dy))


def test_a_pooled_buffer_that_is_not_the_grad_is_dropped():
    x, w, mask, dy = _weight()
    _backward(x, w, mask, dy)
    w.grad = torch.zeros_like(w)  # a .grad of the caller's own (DDP's bucket views do this)
    held = RT.grads._held.get(w)
    y, _ = masked_quant_linear(x.requires_grad_(True), w, None, mask, True, False, RT)
    assert RT.grads._held.get(w) is None or RT.grads._held.get(w) is held  # no new buffer for the codes
    y.backward(dy)
    assert len(RT.grads) == 0
    assert torch.equal(w.grad, _expected(x, dy))


def test_autograd_grad_hands_out_the_buffer_only_while_no_one_holds_it():
    x, w, mask, dy = _weight()
    y, _ = masked_quant_linear(x, w, None, mask, True, False, RT)
    (g1,) = torch.autograd.grad(y, [w], dy)
    y, _ = masked_quant_linear(x, w, None, mask, True, False, RT)
    (g2,) = torch.autograd.grad(y, [w], 2 * dy)
    assert g1.data_ptr() != g2.data_ptr()
    assert torch.equal(g1, _expected(x, dy)) and torch.equal(g2, _expected(x, 2 * dy))


def test_a_weight_moved_to_another_dtype_gets_a_buffer_of_its_own():
    x, w, mask, dy = _weight()
    _backward(x, w, mask, dy)
    w.grad = None
    w.data = w.data.double()  # as model.double() does: the same Parameter, new data
    _backward(x.double(), w, mask, dy.double())
    assert w.grad.dtype == torch.float64
    assert torch.equal(w.grad, _expected(x.double(), dy.double()))


def test_eval_gives_the_buffers_back():
    x, w, mask, dy = _weight()
    _backward(x, w, mask, dy)
    assert len(RT.grads) == 1
    RT.release()
    assert len(RT.grads) == 0
    assert torch.equal(w.grad, _expected(x, dy))  # .grad keeps its memory


def _codes_of_next_forward(w):
    """Where the next forward's grid values go (``codes_for``, as the forward asks)."""
    c = RT.grads.codes_for(w)
    return None if c is None else c.data_ptr()


def test_the_forwards_grid_values_live_in_the_gradient_buffer_they_are_overwritten_by():
    x, w, mask, dy = _weight()
    x = x.requires_grad_(True)  # the backward needs E: the forward keeps its grid values
    y, _ = masked_quant_linear(x, w, None, mask, True, False, RT)
    assert len(RT.grads) == 1
    codes_at = RT.grads._held[w].data_ptr()
    y.backward(dy)
    assert w.grad.data_ptr() == codes_at  # no separate quarter-weight buffer was mapped
    assert torch.equal(w.grad, _expected(x.detach(), dy))
    assert _codes_of_next_forward(w) is None  # .grad holds the buffer: the next codes go elsewhere
    w.grad = None
    assert _codes_of_next_forward(w) == codes_at


def test_while_a_forwards_grid_values_are_there_no_one_else_gets_the_buffer():
    x, w, mask, dy = _weight()
    y, _ = masked_quant_linear(x.requires_grad_(True), w, None, mask, True, False, RT)
    held = RT.grads._held[w]
    assert _codes_of_next_forward(w) is None  # a second forward before the backward
    with torch.no_grad():  # as a backward asks, without the forward's codes
        assert RT.grads.out_for(w, dy) is not held
    del y
    RT.grads._held[w] = held
    assert _codes_of_next_forward(w) is not None  # the graph is gone: free again


def test_a_retained_graphs_second_backward_rebuilds_E_instead_of_reading_overwritten_codes():
    x, w, mask, dy = _weight()
    x = x.requires_grad_(True)
    y, _ = masked_quant_linear(x, w, None, mask, True, False, RT)
    loss = (y * dy).sum()
    loss.backward(retain_graph=True)
    gx1, gw1 = x.grad.clone(), w.grad.clone()
    x.grad = None
    loss.backward()  # the first backward wrote gw over the grid values
    assert torch.equal(x.grad, gx1)  # E rebuilt from the weight: the same bits
    assert torch.equal(w.grad, 2 * gw1)


def test_with_a_grad_kept_the_grid_values_get_a_buffer_of_their_own():
    x, w, mask, dy = _weight()
    x = x.requires_grad_(True)
    _backward(x, w, mask, dy)
    gx1 = x.grad.clone()
    x.grad = None
    assert RT.grads.codes_for(w) is None  # accumulation: .grad is kept, the codes go elsewhere
    y, _ = masked_quant_linear(x, w, None, mask, True, False, RT)
    y.backward(dy)
    assert torch.equal(x.grad, gx1) and torch.equal(w.grad, 2 * _expected(x.detach(), dy))


_CFG = ("retrain_data_quant_config { ulq_quantize { dst_type: INT8 } }\n"
        "retrain_weight_quant_config { arq_retrain { dst_type: INT8 channel_wise: true } }\n"
        "prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 0 } } }\n")


def test_training_with_the_pool_lands_on_the_same_weights_bit_for_bit(tmp_path, monkeypatch):
    import copy

    import openamct as amct
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    cfg = tmp_path / "c.cfg"
    cfg.write_text(_CFG)
    x = torch.randn(8, 64)
    work = amct.create_compressed_retrain_model(model, x, str(cfg), str(tmp_path / "r.txt"), large_model=True)
    twin = copy.deepcopy(work)
    batches = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def train(m):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        m.train()
        ptrs = []
        for b in batches:
            m(b).square().mean().backward()
            ptrs.append(m[2].weight.grad.data_ptr())
            opt.step()
            opt.zero_grad(set_to_none=True)
        return ptrs

    pooled = train(work)
    # Each step wrote into the same memory. (The first layer's input needs no gradient: its
    # clips' gradients take another path, clip_grad.py, with a gradient of its own.)
    pool = work._openamct.large.grads  # the model's runtime (build attached it: a CPU model)
    assert len(set(pooled)) == 1 and pool._held.get(work[2].weight) is not None
    twin_pool = twin._openamct.large.grads  # a deep copy gets a runtime of its own
    assert twin_pool is not pool and twin[2].large.grads is twin_pool
    monkeypatch.setattr(twin_pool, "_alone", None)  # no pool: a fresh gradient every backward
    train(twin)
    assert twin_pool._held.get(twin[2].weight) is None
    for (name, a), b in zip(work.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name


def test_torch_still_has_the_private_storage_use_count_the_pool_relies_on():
    """The pool reads ``torch._C._storage_Use_Count`` (private). Without it the pool lends
    nothing (the plain path); this test fails loudly when torch removes or changes it."""
    count = grad_pool.use_count_api()
    assert count is not None, "torch._C._storage_Use_Count is gone: the gradient pool now never lends"
    t = torch.empty(16)
    alone = count(t.untyped_storage()._cdata)
    view = t[1:]
    assert count(t.untyped_storage()._cdata) == alone + 1, "a view no longer counts as a user of its storage"
    del view
    assert count(t.untyped_storage()._cdata) == alone
    assert grad_pool.GradPool()._alone == alone


def test_without_the_use_count_nothing_is_pooled(monkeypatch):
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    pool = grad_pool.GradPool()
    assert pool._alone is None
    x, w, mask, dy = _weight()
    y, _ = masked_quant_linear(x, w, None, mask, True, False, _runtime_with(pool))
    y.backward(dy)
    assert len(pool) == 0 and torch.equal(w.grad, _expected(x, dy))


def _runtime_with(pool):
    from openamct.large.runtime import LargeRuntime

    rt = LargeRuntime()
    rt.grads = pool
    return rt
