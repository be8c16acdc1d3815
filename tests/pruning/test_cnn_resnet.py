"""The CNN domain on torchvision's ResNet-18 (random weights, BatchNorm statistics from a few
random batches): the residual groups pruned, masks equal removal, reconstruction helps, ORT runs
the export, the state dict reloads into the pruned architecture, and ``openamct.prune``'s CNN
presets run end to end on it."""

import copy

import pytest
import torch

import openamct as amct
from openamct import pruning
from openamct.pruning.domains.cnn import CnnDomain
from tests.runtimes import ort_run
from tests.zoo.torchvision_ops import vision_modules

pytestmark = pytest.mark.slow

SIZE = 64


def _resnet18(seed=0):
    torchvision, _ = vision_modules()
    torch.manual_seed(seed)
    net = torchvision.models.resnet18(num_classes=10)
    net.train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(8, 3, SIZE, SIZE))
    return net.eval()


def _data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 3, SIZE, SIZE, generator=g) for _ in range(n)]


def _keep(units, scores, ratio):
    keep = {}
    for u in units:
        mask = torch.zeros(u.size, dtype=torch.bool)
        mask[scores[u.name].argsort(descending=True)[:u.size - round(u.size * ratio)]] = True
        keep[u.name] = mask
    return keep


def _params(net):
    return sum(p.numel() for p in net.parameters())


@pytest.fixture(scope="module")
def resnet():
    return _resnet18()


def test_units_cover_the_residual_stages_upstream_skips(resnet):
    x = _data(1)[0]
    ours = {u.name: u for u in CnnDomain().units(resnet, x)}
    upstream = {u.name for u in CnnDomain(upstream_rules=True).units(resnet, x)}
    # one unit per stage's residual width: stem + every block's conv2 (+ downsample)
    assert set(ours["conv1"].extra["producers"]) == {"conv1", "layer1.0.conv2", "layer1.1.conv2"}
    assert set(ours["layer4.0.conv2"].extra["producers"]) == {"layer4.0.conv2", "layer4.0.downsample.0",
                                                             "layer4.1.conv2"}
    assert "fc" in ours["layer4.0.conv2"].members
    assert upstream == {n for n in ours if n.endswith(".conv1")} and len(ours) == 12 and len(upstream) == 8


def test_masked_equals_apply_in_place_and_ort_runs_the_export(resnet, tmp_path):
    net, data, x = copy.deepcopy(resnet), _data(2), _data(1, seed=7)[0]
    domain = CnnDomain()
    units = domain.units(net, data[0])
    keep = _keep(units, domain.scores(net, units, data, "l2"), 0.5)
    with domain.masked(net, keep):
        trial = net(x)
    before, n_before = net(x), _params(net)
    assert not torch.allclose(trial, before)
    fc = net.fc
    domain.apply(net, keep, data, reconstruct=False)
    assert net.fc is fc and fc.in_features == 256 and _params(net) < 0.55 * n_before
    with torch.no_grad():
        assert torch.allclose(net(x), trial, atol=1e-4)
        path = tmp_path / "resnet18_pruned.onnx"
        torch.onnx.export(net, (x,), str(path), input_names=["x"], dynamo=False)
        assert torch.allclose(torch.from_numpy(ort_run(str(path), x)), net(x), atol=1e-4)


def test_reconstruction_lowers_the_error_and_the_state_dict_reloads(resnet, tmp_path):
    data, held_out = _data(4), _data(2, seed=11)
    with torch.no_grad():
        want = [resnet(x) for x in held_out]
    domain = CnnDomain()
    plain, solved = copy.deepcopy(resnet), copy.deepcopy(resnet)
    units = domain.units(plain, data[0])
    keep = _keep(units, domain.scores(plain, units, data, "reconstruct"), 0.3)
    domain.apply(plain, keep, data, reconstruct=False)
    domain.apply(solved, keep, data, reconstruct=True)  # a copy of the model units() ran on

    @torch.no_grad()
    def err(m):
        return sum(float((m(x) - w).norm() / w.norm()) for x, w in zip(held_out, want)) / len(want)

    assert err(solved) < 0.9 * err(plain), (err(solved), err(plain))
    torch.save(solved.state_dict(), tmp_path / "pruned.pt")
    fresh = _resnet18(seed=3)
    other = CnnDomain()
    other.units(fresh, data[0])
    other.apply(fresh, keep, [], reconstruct=False)  # the same cut: the pruned architecture
    fresh.load_state_dict(torch.load(tmp_path / "pruned.pt", weights_only=True), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(held_out[0]), solved(held_out[0]))


@pytest.mark.parametrize("preset", ["CNN_VARIANCE_PRUNE_CFG", "CNN_RECONSTRUCT_PRUNE_CFG"])
def test_the_cnn_presets_prune_resnet18_in_place(resnet, preset):
    net, data = copy.deepcopy(resnet), _data(2)
    report = amct.PruneReport()
    n_before = _params(net)
    amct.prune(net, getattr(pruning, preset), data=data, report=report)
    assert report.params_before == n_before and report.params_after == _params(net) < 0.8 * n_before
    with torch.no_grad():
        assert net(data[0]).shape == (8, 10)
