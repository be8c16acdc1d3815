"""A compressed Linear's backward writes the weight gradient where the last step's freed
``.grad`` was (``compressed/grad_pool.py``), and only where no one else still uses that memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from openamct.large import fused_linear
from openamct.large.fused_linear import masked_quant_linear
from tests.unit.test_fused_linear import _case


@pytest.fixture(autouse=True)
def _empty_pool():
    fused_linear.release_scratch()
    yield
    fused_linear.release_scratch()


def _weight(transposed=False):
    x, w, _, mask, dy = _case((2, 9, 64), transposed, False, True)
    return x.detach(), nn.Parameter(w.detach().clone()), mask, dy


def _backward(x, w, mask, dy, transposed=False):
    y, _ = masked_quant_linear(x, w, None, mask, True, transposed)
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
    assert len(fused_linear._grads) == 1  # only the buffer that is .grad itself
    assert fused_linear._grads._held[w].data_ptr() == w.grad.data_ptr()
    w.grad.zero_()  # zero_grad(set_to_none=False): .grad stays, each step's temporary is added
    _backward(x, w, mask, dy)
    assert torch.equal(w.grad, _expected(x, dy))


def test_a_pooled_buffer_that_is_not_the_grad_is_dropped():
    x, w, mask, dy = _weight()
    _backward(x, w, mask, dy)
    w.grad = torch.zeros_like(w)  # a .grad of the caller's own (DDP's bucket views do this)
    y, _ = masked_quant_linear(x.requires_grad_(True), w, None, mask, True, False)
    assert len(fused_linear._codes) == 1  # not in a buffer that will not become .grad
    y.backward(dy)
    assert len(fused_linear._grads) == 0
    assert torch.equal(w.grad, _expected(x, dy))


def test_autograd_grad_hands_out_the_buffer_only_while_no_one_holds_it():
    x, w, mask, dy = _weight()
    y, _ = masked_quant_linear(x, w, None, mask, True, False)
    (g1,) = torch.autograd.grad(y, [w], dy)
    y, _ = masked_quant_linear(x, w, None, mask, True, False)
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
    assert len(fused_linear._grads) == 1
    fused_linear.release_scratch()
    assert len(fused_linear._grads) == 0
    assert torch.equal(w.grad, _expected(x, dy))  # .grad keeps its memory


def _codes_of_next_forward(w):
    """Where the next forward's grid values go (``codes_for``, as the forward asks)."""
    c = fused_linear._grads.codes_for(w)
    return None if c is None else c.data_ptr()


def test_the_forwards_grid_values_live_in_the_gradient_buffer_they_are_overwritten_by():
    x, w, mask, dy = _weight()
    x = x.requires_grad_(True)  # the backward needs E: the forward keeps its grid values
    y, _ = masked_quant_linear(x, w, None, mask, True, False)
    assert len(fused_linear._codes) == 0 and len(fused_linear._grads) == 1
    codes_at = fused_linear._grads._held[w].data_ptr()
    y.backward(dy)
    assert w.grad.data_ptr() == codes_at  # no separate quarter-weight buffer was mapped
    assert torch.equal(w.grad, _expected(x.detach(), dy))
    assert _codes_of_next_forward(w) is None  # .grad holds the buffer: the next codes go elsewhere
    w.grad = None
    assert _codes_of_next_forward(w) == codes_at


def test_while_a_forwards_grid_values_are_there_no_one_else_gets_the_buffer():
    x, w, mask, dy = _weight()
    y, _ = masked_quant_linear(x.requires_grad_(True), w, None, mask, True, False)
    held = fused_linear._grads._held[w]
    assert _codes_of_next_forward(w) is None  # a second forward before the backward
    with torch.no_grad():  # as a backward asks, without the forward's codes
        assert fused_linear._grads.out_for(w, dy) is not held
    del y
    fused_linear._grads._held[w] = held
    assert _codes_of_next_forward(w) is not None  # the graph is gone: free again


def test_a_retained_graphs_second_backward_rebuilds_E_instead_of_reading_overwritten_codes():
    x, w, mask, dy = _weight()
    x = x.requires_grad_(True)
    y, _ = masked_quant_linear(x, w, None, mask, True, False)
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
    y, _ = masked_quant_linear(x, w, None, mask, True, False)  # accumulation: .grad is kept
    assert len(fused_linear._codes) == 1
    y.backward(dy)
    assert torch.equal(x.grad, gx1) and torch.equal(w.grad, 2 * _expected(x.detach(), dy))


_CFG = ("retrain_data_quant_config { ulq_quantize { dst_type: INT8 } }\n"
        "retrain_weight_quant_config { arq_retrain { dst_type: INT8 channel_wise: true } }\n"
        "prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 0 } } }\n")


def test_training_with_the_pool_lands_on_the_same_weights_bit_for_bit(tmp_path, monkeypatch):
    import copy

    import openamct as amct
    from openamct.large import grad_pool

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    cfg = tmp_path / "c.cfg"
    cfg.write_text(_CFG)
    x = torch.randn(8, 64)
    work = amct.create_compressed_retrain_model(model, x, str(cfg), str(tmp_path / "r.txt"))
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
    assert len(set(pooled)) == 1 and fused_linear._grads._held.get(work[2].weight) is not None
    monkeypatch.setattr(grad_pool, "_ALONE", None)  # no pool: a fresh gradient every backward
    train(twin)
    assert fused_linear._grads._held.get(twin[2].weight) is None
    for (name, a), b in zip(work.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name
