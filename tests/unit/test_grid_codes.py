"""A compressed Linear's backward multiplies by the effective weight E again: from the int8 grid
values its forward kept (``large/fused_linear.py``): in the weight's gradient buffer where
that is free (``test_grad_pool.py``), else in a buffer of their own. A frozen weight has no gradient buffer: these tests
use one to reach the lent buffers."""

from __future__ import annotations

import pytest
import torch

from openamct.large import fused_linear
from openamct.large.fused_linear import masked_quant_linear
from tests.unit.test_fused_linear import RT, _case, _composed


def _gx(x, w, mask, channel_wise, transposed, dy):
    y, _ = masked_quant_linear(x, w, None, mask, channel_wise, transposed, RT)
    return torch.autograd.grad(y, [x], dy)[0]


def _gx_ref(x, w, mask, channel_wise, transposed, dy):
    return torch.autograd.grad(_composed(x, w, None, mask, channel_wise, transposed), [x], dy)[0]


def _no_rebuild(*args, **kwargs):
    raise AssertionError("the backward rebuilt E from the weight")


@pytest.mark.parametrize("rows", [0, None])  # E built whole, or a slice at a time
@pytest.mark.parametrize("transposed,channel_wise", [(False, True), (True, True), (False, False), (True, False)])
def test_the_backward_multiplies_by_the_forwards_grid_values(transposed, channel_wise, rows, monkeypatch):
    if rows is not None:
        monkeypatch.setattr(fused_linear, "SLICED_MAX_ROWS", rows)
    monkeypatch.setattr(fused_linear, "_CHUNK_ELEMS", 7 * 64 + 5)  # several slices, the last short
    x, w, _, mask, dy = _case((2, 9, 64), transposed, False, True)
    y, _ = masked_quant_linear(x, w, None, mask, channel_wise, transposed, RT)
    monkeypatch.setattr(fused_linear, "_masked_into", _no_rebuild)  # only the forward may build E
    (gx,) = torch.autograd.grad(y, [x], dy)
    monkeypatch.undo()
    ref = _gx_ref(x, w, mask, channel_wise, transposed, dy)
    if rows == 0:
        assert torch.equal(gx, ref)  # the same E, bit for bit, and the same matmul
    else:
        torch.testing.assert_close(gx, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_weight_that_is_not_finite_gives_the_composed_input_gradient(bad, monkeypatch):
    """int8 cannot hold what q(inf) or q(nan) gives: the backward dequantizes such a channel
    with a NaN scale (no host read of the scales), so the input gradient is what the composed
    path gives (NaN where it has NaN)."""
    monkeypatch.setattr(fused_linear, "SLICED_MAX_ROWS", 0)
    x, w, _, mask, dy = _case((5, 64), False, False, True)
    with torch.no_grad():
        w[3, 0], w[3, 1] = bad, 1.0
    mask = mask.clone()
    mask[(3 * 64) // 8] = 0b11000000  # keep the bad weight
    called = []
    real = fused_linear._dequantized_product
    monkeypatch.setattr(fused_linear, "_dequantized_product", lambda *a, **k: called.append(1) or real(*a, **k))
    gx = _gx(x, w, mask, True, False, dy)
    assert called
    ref = _gx_ref(x, w, mask, True, False, dy)
    assert not bool(torch.isfinite(ref).all())  # the case is a real one
    torch.testing.assert_close(gx, ref, rtol=0, atol=0, equal_nan=True)


def _shared_layer_twice(w, mask, x1, x2):
    y1, _ = masked_quant_linear(x1, w, None, mask, True, False, RT)
    y2, _ = masked_quant_linear(x2, w, None, mask, True, False, RT)
    return y1, y2


def test_a_layer_called_twice_before_its_backward_keeps_both_grid_values():
    # Shared layers (ALBERT), or two forwards then one backward: each context has its buffer.
    RT.release()
    x, w, _, mask, dy = _case((5, 64), False, False, True)
    x2 = (x.detach() * 3).requires_grad_(True)
    w2 = w.detach().clone().requires_grad_(True)
    y1, y2 = _shared_layer_twice(w, mask, x, x2)
    assert len(RT.grads) == 1  # the first call's are in w's gradient buffer, the second's their own
    y1_ref, y2_ref = _shared_layer_twice(w2, mask, x.detach().requires_grad_(True), x2.detach().requires_grad_(True))
    got = torch.autograd.grad((y1 * y2).sum(), [x, x2, w])
    x_r, x2_r = x.detach().requires_grad_(True), x2.detach().requires_grad_(True)
    ref = torch.autograd.grad((_composed(x_r, w2, None, mask, True, False)
                               * _composed(x2_r, w2, None, mask, True, False)).sum(), [x_r, x2_r, w2])
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    del y1_ref, y2_ref


def test_a_retained_graphs_second_backward_reads_its_own_grid_values():
    RT.release()
    x, w, _, mask, dy = _case((5, 64), False, False, True)
    w = w.detach()  # frozen: its grid values are lent
    for _ in range(3):
        _gx(x, w, mask, True, False, dy)
    y, _ = masked_quant_linear(x, w, None, mask, True, False, RT)
    loss = (y * dy).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    w_other = w * -2  # same shape: it must not reuse y's buffer
    _gx(x, w_other, mask, True, False, dy)
    loss.backward()  # the retained graph's second backward reads its own grid values
    assert torch.equal(x.grad, first)


def test_eval_gives_the_buffers_back():
    RT.release()
    x, w, _, mask, dy = _case((5, 64), False, False, True)
    _gx(x, w.detach(), mask, True, False, dy)
    _gx(x, w, mask, True, False, dy)
    assert len(RT.grads) == 1
    RT.release()
    assert len(RT.grads) == 0
