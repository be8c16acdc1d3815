"""The test model zoo (tests/models.py), the demo model (openamct.demo.models) and the benchmark
models (benchmarks/models.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.models import mlp, resnet18, resnet_depth, resnet_with_conv_layers
from openamct.demo.models import MnistNet
from tests.models import INPUT_SHAPES, MODELS, OUTPUT_SHAPES, example_input


def _count(model: nn.Module, kind: type[nn.Module]) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


# ---------------------------------------------------------------- test zoo


def test_zoo_tables_agree():
    assert set(MODELS) == set(INPUT_SHAPES) == set(OUTPUT_SHAPES)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_zoo_forward_gives_documented_shape(name):
    model = MODELS[name]().eval()
    with torch.no_grad():
        out = model(example_input(name))
    assert tuple(out.shape) == OUTPUT_SHAPES[name]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"UntraceableNet"}))
def test_zoo_is_fx_traceable_except_untraceable(name):
    model = MODELS[name]().eval()
    gm = torch.fx.symbolic_trace(model)
    x = example_input(name)
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))


def test_untraceable_net_defeats_fx_and_takes_both_branches():
    model = MODELS["UntraceableNet"]().eval()
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    x = torch.ones(INPUT_SHAPES["UntraceableNet"])
    with torch.no_grad():
        pos, neg = model(x), model(-x)
        assert torch.allclose(pos, model.head(torch.relu(model.conv_pos(x))))
        assert torch.allclose(neg, model.head(torch.relu(model.conv_neg(-x))))


def test_net001_names_and_layers_match_upstream():
    model = MODELS["Net001"]()
    modules = dict(model.named_modules())
    for name in ("layer1.0", "layer2.0", "layer3.0", "layer4.0", "layer5.0", "layer6.0"):
        assert isinstance(modules[name], nn.Conv2d), name
    assert modules["layer1.0"].bias is None and modules["layer2.0"].bias is not None
    assert modules["layer3.0"].groups == 16 and modules["layer5.0"].groups == 4
    assert modules["layer6.0"].groups == 8
    assert [n for n, m in modules.items() if isinstance(m, nn.Linear)] == ["fc.0", "fc.2", "fc.5"]
    assert modules["fc.0"].in_features == 8 * 16 * 16 and modules["fc.2"].bias is None


def test_eltwise_group_net_has_two_grouped_160_channel_producers():
    modules = dict(MODELS["EltwiseGroupNet"]().named_modules())
    for name in ("layer1.0", "layer2.0"):
        assert modules[name].out_channels == 160 and modules[name].groups == 2
    assert modules["layer3.0"].in_channels == 160 and modules["layer3.0"].groups == 2


def test_reused_module_net_calls_shared_conv_twice():
    model = MODELS["ReusedModuleNet"]()
    calls = []
    model.shared.register_forward_hook(lambda *_: calls.append(1))
    model(example_input("ReusedModuleNet"))
    assert len(calls) == 2 and _count(model, nn.Conv2d) == 2


def test_shared_weight_net_ties_weights():
    model = MODELS["SharedWeightNet"]()
    assert model.fc1.weight is model.fc2.weight
    assert [n for n, _ in model.named_parameters()] == ["fc1.weight", "fc1.bias", "fc2.bias"]
    assert "fc2.weight" in model.state_dict()


def test_mobilenet_tiny_residuals_only_where_shapes_match():
    feats = MODELS["MobileNetV2Tiny"]().features
    assert [feats[i].use_res for i in (1, 2, 3)] == [True, False, True]
    assert feats[1].conv[3].groups == feats[1].conv[3].in_channels == 64


def test_unet_tiny_has_conv_transpose():
    assert _count(MODELS["UNetTiny"](), nn.ConvTranspose2d) == 1


# ---------------------------------------------------------------- demo models


def test_mnist_net_shape_and_names():
    model = MnistNet().eval()
    with torch.no_grad():
        assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert convs == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    assert all(model.get_submodule(n).out_channels % 16 == 0 for n in convs)
    with pytest.raises(ValueError, match="widths"):
        MnistNet(widths=(16, 32))


# torchvision.models.resnet18() names (torchvision does not import here, so spelled out).
_TV_BLOCK = ["conv1", "bn1", "relu", "conv2", "bn2"]


def _torchvision_resnet18_names() -> list[str]:
    names = ["", "conv1", "bn1", "relu", "maxpool"]
    for stage in range(1, 5):
        names.append(f"layer{stage}")
        for block in range(2):
            prefix = f"layer{stage}.{block}"
            names.append(prefix)
            names += [f"{prefix}.{n}" for n in _TV_BLOCK]
            if block == 0 and stage > 1:
                names += [f"{prefix}.downsample", f"{prefix}.downsample.0", f"{prefix}.downsample.1"]
    return names + ["avgpool", "fc"]


def test_resnet18_matches_torchvision_layout():
    model = resnet18()
    assert sorted(n for n, _ in model.named_modules()) == sorted(_torchvision_resnet18_names())
    assert sum(p.numel() for p in model.parameters()) == 11_689_512  # torchvision's count
    assert _count(model, nn.Conv2d) == 20 and _count(model, nn.Linear) == 1
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert isinstance(model.maxpool, nn.MaxPool2d)
    assert model.layer2.get_submodule("0.downsample.0").kernel_size == (1, 1)
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, 64, 64)).shape == (1, 1000)


def test_resnet18_cifar_stem():
    model = resnet18(num_classes=10, cifar_stem=True).eval()
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


@pytest.mark.parametrize("n", [18, 66, 258])
def test_resnet_with_conv_layers_exact_count(n):
    model = resnet_with_conv_layers(n)
    assert _count(model, nn.Conv2d) == n and _count(model, nn.Linear) == 1
    if n == 18:
        with torch.no_grad():
            assert model.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_resnet_depth_conv_arithmetic():
    model = resnet_depth([1, 2, 3], width=8)
    assert _count(model, nn.Conv2d) == 1 + 2 * 6 + 2
    assert model.layer3[0].conv1.out_channels == 32
    with pytest.raises(ValueError, match="even"):
        resnet_with_conv_layers(19)


def test_mlp_stack_shape_and_layers():
    model = mlp(layers=2, d=32, hidden=64).eval()
    with torch.no_grad():
        assert model(torch.zeros(3, 5, 32)).shape == (3, 5, 32)
    assert [n for n, m in model.named_modules() if isinstance(m, nn.Linear)] == [
        "layers.0.fc1", "layers.0.fc2", "layers.1.fc1", "layers.1.fc2"
    ]
    big = mlp()
    assert _count(big, nn.Linear) == 12 and big.layers[0].fc1.out_features == 3072
