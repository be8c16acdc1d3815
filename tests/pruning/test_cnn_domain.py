"""The CNN channel domain on hand-built nets: a residual add, a concat consumer, a depthwise
chain and a grouped conv, each a coupled group openamct prunes and upstream's rules skip."""

import copy

import pytest
import torch
from torch import nn

from openamct.pruning.domains.cnn import CnnDomain
from tests.runtimes import ort_run


def _bn_relu(c):
    return [nn.BatchNorm2d(c), nn.ReLU()]


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), *_bn_relu(16))
        self.a = nn.Sequential(nn.Conv2d(16, 24, 3, padding=1, bias=False), *_bn_relu(24))
        self.b = nn.Sequential(nn.Conv2d(24, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(x + self.b(self.a(x)))
        return self.head(x.mean((2, 3)))


class Concat(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), *_bn_relu(12))
        self.right = nn.Sequential(nn.Conv2d(3, 20, 1), *_bn_relu(20))
        self.mix = nn.Sequential(nn.Conv2d(32, 16, 3, padding=1), *_bn_relu(16))
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = self.mix(torch.cat([self.left(x), self.right(x)], 1))
        return self.head(nn.functional.adaptive_avg_pool2d(x, 4).flatten(1))


class Depthwise(nn.Module):
    def __init__(self):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(3, 24, 1, bias=False), *_bn_relu(24))
        self.dw = nn.Sequential(nn.Conv2d(24, 24, 3, padding=1, groups=24, bias=False), *_bn_relu(24))
        self.project = nn.Sequential(nn.Conv2d(24, 16, 1), *_bn_relu(16))
        self.grouped = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=2), *_bn_relu(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.grouped(self.project(self.dw(self.expand(x))))
        return self.head(x.mean((2, 3)))


NETS = {"residual": Residual, "concat": Concat, "depthwise": Depthwise}


def _net(name):
    torch.manual_seed(0)
    net = NETS[name]()
    net.train()
    with torch.no_grad():  # BatchNorm statistics of a real input distribution
        for _ in range(5):
            net(torch.randn(16, 3, 16, 16))
    return net.eval()


def _data(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 3, 16, 16, generator=g) for _ in range(n)]


def _keep(domain, net, units, data, ratio, criterion="variance"):
    """The ``ratio`` of each unit with the lowest scores cut, equal per block of a grouped unit."""
    scores = domain.scores(net, units, data, criterion)
    keep = {}
    for u in units:
        blocks = u.extra["prune_group"]
        blk = u.size // blocks
        drop = round(blk * ratio)
        mask = torch.ones(u.size, dtype=torch.bool)
        for b in range(blocks):
            order = scores[u.name][b * blk:(b + 1) * blk].argsort()
            mask[b * blk + order[:drop]] = False
        keep[u.name] = mask
    return keep


def _params(net):
    return sum(p.numel() for p in net.parameters())


def test_units_include_the_coupled_groups_upstream_skips():
    r = CnnDomain().units(_net("residual"), _data(1)[0])
    coupled = next(u for u in r if u.name == "stem.0")
    assert set(coupled.extra["producers"]) == {"stem.0", "b.0"}
    assert {"stem.1", "b.1", "a.0", "head"} <= set(coupled.members)
    c = CnnDomain().units(_net("concat"), _data(1)[0])
    assert {u.name for u in c} == {"left.0", "right.0", "mix.0"}
    assert "mix.0" in next(u for u in c if u.name == "right.0").members
    d = CnnDomain().units(_net("depthwise"), _data(1)[0])
    expand = next(u for u in d if u.name == "expand.0")
    assert {"dw.0", "dw.1", "project.0"} <= set(expand.members)
    assert next(u for u in d if u.name == "project.0").extra["prune_group"] == 2
    for units in (r, c, d):
        assert all(u.params_per_channel > 0 for u in units)
    # the stem unit: 27 weights of each of two producers (stem.0: 3·3·3; b.0: 24·3·3 = 216),
    # 2 per BatchNorm, a.0's 24·9 input weights, head's 10 columns
    assert coupled.params_per_channel == 27 + 216 + 2 + 2 + 216 + 10


def test_upstream_rules_skip_residual_concat_and_depthwise_groups():
    x = _data(1)[0]
    assert {u.name for u in CnnDomain(upstream_rules=True).units(_net("residual"), x)} == {"a.0"}
    assert {u.name for u in CnnDomain(upstream_rules=True).units(_net("concat"), x)} == {"mix.0"}
    assert CnnDomain(upstream_rules=True).units(_net("depthwise"), x) == []


@pytest.mark.parametrize("name", list(NETS))
def test_masked_trial_equals_apply_and_leaves_the_model_as_it_was(name):
    net, data, x = _net(name), _data(), _data(1, seed=9)[0]
    before = net(x)
    domain = CnnDomain()
    units = domain.units(net, data[0])
    keep = _keep(domain, net, units, data, 0.5)
    with domain.masked(net, keep):
        trial = net(x)
    assert torch.equal(net(x), before)  # hooks gone on exit
    assert not any(m._forward_pre_hooks for m in net.modules())
    assert not torch.allclose(trial, before)
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    n_before = _params(net)
    exact = domain.params_removed(net, keep)
    assert _params(net) == n_before and exact > 0
    domain.apply(net, keep, data, reconstruct=False)
    assert torch.allclose(net(x), trial, atol=1e-5)
    assert _params(net) == n_before - exact
    # in place, and the kept channels' weights are the old ones
    kept = keep[units[0].name].nonzero().flatten()
    name0 = units[0].name
    assert torch.equal(net.get_submodule(name0).weight, weights[f"{name0}.weight"].index_select(0, kept))


@pytest.mark.parametrize("name", list(NETS))
def test_keeping_every_channel_changes_nothing(name):
    net, data = _net(name), _data(2)
    x = data[1]
    domain = CnnDomain()
    units = domain.units(net, data[0])
    before, n_before = net(x), _params(net)
    keep = {u.name: torch.ones(u.size, dtype=torch.bool) for u in units}
    with domain.masked(net, keep):
        assert torch.equal(net(x), before)
    domain.apply(net, keep, data, reconstruct=True)
    assert torch.equal(net(x), before) and _params(net) == n_before


@pytest.mark.parametrize("name", list(NETS))
def test_reconstruction_lowers_the_error_on_held_out_inputs(name):
    net, data, held_out = _net(name), _data(6), _data(2, seed=5)
    want = [net(x) for x in held_out]
    domain = CnnDomain()
    units = domain.units(net, data[0])
    keep = _keep(domain, net, units, data, 0.5, "reconstruct")
    plain, solved = copy.deepcopy(net), copy.deepcopy(net)
    domain.apply(plain, keep, data, reconstruct=False)
    domain.apply(solved, keep, data, reconstruct=True)

    @torch.no_grad()
    def err(m):
        return sum(float((m(x) - w).norm() / w.norm()) for x, w in zip(held_out, want)) / len(want)

    assert err(solved) < 0.8 * err(plain), (err(solved), err(plain))
    if name == "residual":  # b.0 has no bias: the bias it would need went into b.1's running mean
        assert not torch.allclose(solved.b[1].running_mean, plain.b[1].running_mean)


@pytest.mark.parametrize("name", list(NETS))
def test_pruned_model_exports_runs_in_ort_and_reloads(tmp_path, name):
    net, data = _net(name), _data()
    domain = CnnDomain()
    units = domain.units(net, data[0])
    keep = _keep(domain, net, units, data, 0.3, "l2")
    domain.apply(net, keep, data, reconstruct=True)
    x = _data(1, seed=3)[0]
    path = tmp_path / "pruned.onnx"
    torch.onnx.export(net, (x,), str(path), input_names=["x"], dynamo=False)
    assert torch.allclose(torch.from_numpy(ort_run(str(path), x)), net(x), atol=1e-4)
    torch.save(net.state_dict(), tmp_path / "pruned.pt")
    # the pruned architecture, rebuilt by cutting the same channels from a fresh model
    torch.manual_seed(7)
    fresh = NETS[name]().eval()
    other = CnnDomain()
    other.units(fresh, data[0])
    other.apply(fresh, keep, [], reconstruct=False)
    fresh.load_state_dict(torch.load(tmp_path / "pruned.pt", weights_only=True), strict=True)
    assert torch.equal(fresh(x), net(x))


def test_scores_rank_a_constant_channel_last_and_norms_differ():
    net, data = _net("concat"), _data()
    with torch.no_grad():  # channel 5 of left.0 is its bias alone: a constant
        net.left[0].weight[5].zero_()
    domain = CnnDomain()
    units = domain.units(net, data[0])
    var = domain.scores(net, units, data, "variance")["left.0"]
    assert var.shape == (12,) and int(var.argmin()) == 5 and float(var[5]) < 1e-8
    l1, l2 = (domain.scores(net, units, data, c)["left.0"] for c in ("l1", "l2"))
    assert int(l1.argmin()) == 5 and not torch.allclose(l1, l2)
    assert torch.equal(domain.scores(net, units, data, "reconstruct")["left.0"], var)


def test_bad_input_is_refused_before_any_change():
    net, data = _net("depthwise"), _data(2)
    domain = CnnDomain()
    units = domain.units(net, data[0])
    state = {k: v.clone() for k, v in net.state_dict().items()}
    full = {u.name: torch.ones(u.size, dtype=torch.bool) for u in units}
    with pytest.raises(ValueError, match="criterion"):
        domain.scores(net, units, data, "taylor")
    with pytest.raises(ValueError, match="shape"):
        domain.apply(net, {"expand.0": torch.ones(5, dtype=torch.bool)}, data, reconstruct=False)
    with pytest.raises(ValueError, match="keeps no channel"):
        domain.apply(net, {**full, "expand.0": torch.zeros(24, dtype=torch.bool)}, data, reconstruct=False)
    with pytest.raises(ValueError, match="unknown unit"):
        domain.masked(net, {"nope": torch.ones(3, dtype=torch.bool)})
    with pytest.raises(ValueError, match="calibration data"):
        domain.apply(net, full, [], reconstruct=True)
    domain.options = {"recovery": "exact"}
    with pytest.raises(ValueError, match="recovery"):
        domain.apply(net, full, data, reconstruct=True)
    after = net.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)
    with pytest.raises(ValueError, match="upstream_rules|ridge"):
        CnnDomain(ridge=0)


def test_apply_forgets_the_units_of_the_model_it_changed():
    net, data = _net("residual"), _data(2)
    domain = CnnDomain()
    units = domain.units(net, data[0])
    keep = _keep(domain, net, units, data, 0.25, "l1")
    domain.apply(net, keep, data, reconstruct=False)
    with pytest.raises(ValueError, match="call units"):
        domain.apply(net, keep, data, reconstruct=False)
    again = domain.units(net, data[0])
    assert {u.name: u.size for u in again} == {u.name: int(keep[u.name].sum()) for u in units}


def test_a_grouped_unit_loses_as_many_channels_in_each_block():
    net, data, x = _net("depthwise"), _data(2), _data(1, seed=4)[0]
    domain = CnnDomain()
    units = domain.units(net, data[0])
    scores = domain.scores(net, units, data, "variance_channel")
    bias = net.project[0].bias.detach().clone()
    keep = torch.ones(16, dtype=torch.bool)
    keep[:3] = False  # all from the first of project.0's two blocks (grouped.0 has groups=2)
    with domain.masked(net, {"project.0": keep}):
        trial = net(x)
    domain.apply(net, {"project.0": keep}, data, reconstruct=False)
    # 13 kept becomes 7 in each block of 8 (rounded up): the first block keeps channels 3..7
    # and the best two of 0..2, the second drops its lowest-scored channel
    assert net.project[0].out_channels == 14 and net.grouped[0].in_channels == 14
    assert torch.allclose(net(x), trial, atol=1e-5)
    s = scores["project.0"]
    first = sorted([*range(3, 8), *(int(i) for i in s[:3].argsort(descending=True)[:2])])
    second = sorted(8 + int(i) for i in s[8:].argsort(descending=True)[:7])
    assert torch.equal(net.project[0].bias, bias.index_select(0, torch.tensor(first + second)))


@pytest.mark.parametrize("name,recovery", [("concat", "bias"), ("residual", "bias"), ("concat", "none")])
def test_recovery_options_of_the_reconstruct_method(name, recovery):
    net, data, held_out = _net(name), _data(4), _data(2, seed=5)
    with torch.no_grad():
        want = [net(x) for x in held_out]
    domain = CnnDomain()
    units = domain.units(net, data[0])
    keep = _keep(domain, net, units, data, 0.5)
    plain = copy.deepcopy(net)
    domain.apply(plain, keep, data, reconstruct=False)
    domain.options = {"recovery": recovery}
    domain.apply(net, keep, data, reconstruct=True)
    with torch.no_grad():
        got = [net(x) for x in held_out]
        cut = [plain(x) for x in held_out]
    if recovery == "none":
        assert all(torch.equal(a, b) for a, b in zip(got, cut))
    else:  # the cut channels' means moved into the consumers' biases (concat's mix.0) or into the
        # running means of the BatchNorms after consumers without one (residual's a.0, b.0): closer
        err = sum(float((g - w).norm()) for g, w in zip(got, want))
        assert err < sum(float((c - w).norm()) for c, w in zip(cut, want))
        assert not domain.warnings


@pytest.mark.parametrize("preset", ["CNN_VARIANCE_PRUNE_CFG", "CNN_RECONSTRUCT_PRUNE_CFG"])
@pytest.mark.parametrize("mode", [{"tolerance": 0.2}, {"size_budget": 0.6}])
def test_the_family_searches_run_on_the_cnn_domain(preset, mode):
    import openamct as amct
    from openamct import pruning

    net, data = _net("residual"), _data(4)
    conv = net.stem[0]
    report = amct.PruneReport()
    amct.prune(net, getattr(pruning, preset), data=data, report=report, **mode)
    assert net.stem[0] is conv and report.chosen_ratio is not None
    assert report.params_after == _params(net) < report.params_before
    with torch.no_grad():
        assert net(data[0]).shape == (16, 10)
