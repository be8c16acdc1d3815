"""A shared ActULQ (q/k/v, gate/up read one tensor) quantizes a tensor once for all its readers:
the same output object, the same values and gradients as separate calls, and a new output as
soon as the tensor, the clips or the grad mode change (quant/quantizers.py)."""

from __future__ import annotations

import copy
import gc
import io

import torch

from openamct.quant.quantizers import ActULQ


def _quantizer() -> ActULQ:
    return ActULQ(clip_max=2.5, clip_min=-1.5)


def test_readers_of_one_tensor_get_one_output_with_the_gradients_of_separate_calls():
    torch.manual_seed(0)
    x = (torch.randn(6, 32) * 2).requires_grad_(True)
    w = [torch.randn(32, 8) for _ in range(3)]
    q = _quantizer()
    ys = [q(x) for _ in range(3)]
    assert ys[0] is ys[1] is ys[2]
    sum((y @ wi).square().sum() for y, wi in zip(ys, w)).backward()
    ref_q, x_ref = _quantizer(), x.detach().clone().requires_grad_(True)
    loss = 0
    for wi in w:  # three separate fake quants, as before
        ref_q._last = None
        loss = loss + (ref_q(x_ref) @ wi).square().sum()
    loss.backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q.clip_max.grad, ref_q.clip_max.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q.clip_min.grad, ref_q.clip_min.grad, rtol=1e-5, atol=1e-6)


def test_a_change_of_tensor_clips_or_grad_mode_quantizes_again():
    x = torch.randn(4, 16) * 3
    q = _quantizer()
    y = q(x)
    assert q(x) is y
    with torch.no_grad():
        assert q(x) is not y  # another grad mode
    assert q(x.clone()) is not y  # another tensor with the same values
    y = q(x)
    x.mul_(0.5)  # the same tensor, modified in place
    y2 = q(x)
    assert y2 is not y and torch.equal(y2, q(x))
    with torch.no_grad():
        q.clip_max.fill_(1.0)  # an optimizer step changes the clips in place
    y3 = q(x)
    assert y3 is not y2 and float(y3.detach().max()) <= 1.0 + 1e-6
    q.load_state_dict({**q.state_dict(), "clip_max": torch.tensor(4.0)})
    assert q(x) is not y3


def test_the_output_lives_only_as_long_as_its_readers_keep_it():
    x = torch.randn(4, 16)
    q = _quantizer()
    y = q(x)
    values = y.detach().clone()
    del y
    gc.collect()
    assert q._last[2]() is None  # the quantizer kept no reference of its own
    assert torch.equal(q(x), values)  # computed again


def test_inference_mode_and_copies_work():
    q = _quantizer()
    x = torch.randn(4, 16)
    y = q(x)
    with torch.inference_mode():
        xi = torch.randn(4, 16)
        assert torch.equal(q(xi), q(xi))
    q2 = copy.deepcopy(q)
    torch.save(q, buf := io.BytesIO())  # a whole-module pickle: the weak references are left out
    buf.seek(0)
    q3 = torch.load(buf, weights_only=False)
    for other in (q2, q3):
        assert torch.equal(other(x), y)
