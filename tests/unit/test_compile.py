"""``torch.compile`` of a returned model: one graph per training forward (the record keeper's
hooks run eagerly around it), no recompilation from step to step, the eager steps' results, and
the host copies of the quantizers' flags kept honest when a checkpoint is loaded into it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from openamct.quant.quantizers import ActULQ
from tests.unit.test_device_step import CASES, IDS, _calibrated


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("kind,cfg", CASES[1:3] + CASES[4:], ids=IDS[1:3] + IDS[4:])
def test_a_training_forward_compiles_to_one_graph(tmp_path, kind, cfg):
    m, x, _ = _calibrated(tmp_path, kind, cfg)
    explained = torch._dynamo.explain(lambda inp: m(inp).square().mean())(x)
    reasons = [str(r.reason) for r in explained.break_reasons]
    # The one break: the keeper's pre-forward hook (snapshots, counters) runs eagerly.
    assert explained.graph_break_count <= 1, reasons
    assert all("RecordKeeper.before_forward" in r for r in reasons), reasons


@pytest.mark.parametrize("kind,cfg", [CASES[1], CASES[3]], ids=[IDS[1], IDS[3]])
def test_compiled_steps_match_eager_steps_without_recompiling(tmp_path, kind, cfg):
    m, x, _ = _calibrated(tmp_path, kind, cfg)
    eager = copy.deepcopy(m)
    compiled = torch.compile(m, backend="eager")
    for model, params in ((eager, eager.parameters()), (compiled, m.parameters())):
        opt = torch.optim.SGD(params, lr=0.05)
        for _ in range(5):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for (name, a), b in zip(eager.state_dict().items(), m.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_loaded_state_reaches_a_compiled_quantizer():
    """A compiled forward reads ``initialized`` from the quantizer's host copy; a state-dict load
    drops the copy, so loading an uncalibrated state makes the next compiled forward calibrate."""
    q = ActULQ()
    x = torch.randn(64)
    fresh = copy.deepcopy(q.state_dict())
    q.train()
    q(x)
    compiled = torch.compile(q, backend="eager")
    compiled(x)
    assert q.is_initialized and int(q.init_batches) == 1
    q.load_state_dict(fresh)
    compiled(x * 3)
    assert int(q.init_batches) == 1 and float(q.clip_max.detach()) > float(x.max()) * 2
