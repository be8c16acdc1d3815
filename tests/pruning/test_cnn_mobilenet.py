"""The CNN domain on torchvision's MobileNetV2 (random weights): depthwise chains and the
inverted-residual adds, both of which upstream's rules skip, cut with masks equal to removal,
the exact parameter count, and an export ORT runs."""

import copy

import pytest
import torch

from openamct.pruning.domains.cnn import CnnDomain
from tests.runtimes import ort_run
from tests.zoo.torchvision_ops import vision_modules

pytestmark = pytest.mark.slow


def test_mobilenet_v2_depthwise_and_residual_units(tmp_path):
    torchvision, _ = vision_modules()
    torch.manual_seed(0)
    net = torchvision.models.mobilenet_v2(num_classes=10)
    net.train()
    with torch.no_grad():
        net(torch.randn(8, 3, 64, 64))
    net.eval()
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 3, 64, 64, generator=g) for _ in range(2)]
    domain = CnnDomain()
    units = {u.name: u for u in domain.units(net, data[0])}
    assert len(CnnDomain(upstream_rules=True).units(net, data[0])) < len(units) // 4
    # an expansion conv's unit carries the depthwise conv and its BatchNorm to the projection
    expand = units["features.2.conv.0.0"]
    assert {"features.2.conv.1.0", "features.2.conv.1.1", "features.2.conv.2"} <= set(expand.members)
    # the residual width of stage 2 couples both projections of its blocks
    assert set(units["features.2.conv.2"].extra["producers"]) == {"features.2.conv.2", "features.3.conv.2"}
    scores = domain.scores(net, list(units.values()), data, "variance")
    keep = {n: scores[n] >= scores[n].median() for n in units}
    x = data[1]
    with torch.no_grad(), domain.masked(net, keep):
        trial = net(x)
    before = sum(p.numel() for p in net.parameters())
    exact = domain.params_removed(net, keep)
    pruned = copy.deepcopy(net)
    domain.apply(pruned, keep, data, reconstruct=False)
    assert sum(p.numel() for p in pruned.parameters()) == before - exact
    with torch.no_grad():
        out = pruned(x)
        assert torch.allclose(out, trial, rtol=1e-4, atol=1e-5 * float(trial.abs().max()))
        path = tmp_path / "mobilenet_v2_pruned.onnx"
        torch.onnx.export(pruned, (x,), str(path), input_names=["x"], dynamo=False)
        assert torch.allclose(torch.from_numpy(ort_run(str(path), x)), out, rtol=1e-4,
                              atol=1e-5 * float(out.abs().max()))
