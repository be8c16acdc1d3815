"""Norm modules whose own forward calls the functional norm (timm's BatchNormAct2d and
GroupNormAct: a BatchNorm2d / GroupNorm subclass running F.batch_norm / F.group_norm and then an
activation child; timm's and torchvision's LayerNorm2d: a LayerNorm subclass that permutes
around F.layer_norm) follow a filter-prune decision like the plain modules, and so does a module
owning only scalars or a (C,) vector it reshapes itself that works on each channel alone
(HGNetV2's LearnableAffineBlock, EfficientFormerV2's LayerScale2d); what cannot follow says why."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.sparsity.filter import apply_removal
from openamct.sparsity.filter_record import groups_from_records, groups_to_records
from tests.pruning import select_filters

X = torch.randn(2, 3, 8, 8)


class BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d: F.batch_norm with the module's tensors, then an activation child."""

    def __init__(self, c):
        super().__init__(c)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                     self.training, self.momentum, self.eps))


class GroupNormAct(nn.GroupNorm):
    def __init__(self, groups, c):
        super().__init__(groups, c)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class LayerNorm2d(nn.LayerNorm):
    """A LayerNorm over the channels of an NCHW tensor (permute, F.layer_norm, permute back)."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class FlippedLayerNorm2d(LayerNorm2d):
    """Normalises the channels, then reverses their order: the channels do not stay in place."""

    def forward(self, x):
        return super().forward(x).flip(1)


class Affine(nn.Module):
    """HGNetV2's LearnableAffineBlock: a learnt scalar scale and bias."""

    def __init__(self):
        super().__init__()
        self.scale, self.bias = nn.Parameter(torch.tensor([1.5])), nn.Parameter(torch.tensor([0.2]))

    def forward(self, x):
        return self.scale * x + self.bias


class ScaledSoftmax(Affine):
    """Scalars too, but a softmax over the channels: each output reads every channel."""

    def forward(self, x):
        return torch.softmax(self.scale * x, dim=1)


class LayerScale2d(nn.Module):
    """timm's LayerScale2d: a (C,) gamma viewed to (1, C, 1, 1) in the forward."""

    def __init__(self, c):
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        return x * self.gamma.view(1, -1, 1, 1)


class ScaleThenFlip(LayerScale2d):
    def forward(self, x):
        return super().forward(x).flip(1)


class Net(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv2d(3, 16, 3, padding=1), norm, nn.Conv2d(16, 8, 1)
        with torch.no_grad():
            for name, t in norm.named_parameters():
                t.uniform_(0.5, 1.5) if name == "weight" else t.uniform_(-0.5, 0.5)
            if isinstance(norm, nn.BatchNorm2d):
                norm.running_mean.uniform_(-1, 1)
                norm.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.conv2(self.norm(self.conv1(x))).mean((2, 3))


class TwiceNet(nn.Module):
    """One BatchNormAct called on two layers' outputs: its statistics serve both."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm, self.out = nn.Conv2d(3, 16, 1), nn.Conv2d(3, 16, 1), BatchNormAct(16), nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return self.out(self.norm(self.a(x)) + self.norm(self.b(x))).mean((2, 3))


class ComputedWeightNet(nn.Module):
    """F.batch_norm with a weight computed in the forward: there is no module to slice."""

    def __init__(self):
        super().__init__()
        self.conv, self.g, self.out = nn.Conv2d(3, 16, 1), nn.Parameter(torch.ones(16)), nn.Conv2d(16, 4, 1)
        self.register_buffer("mean", torch.zeros(16))
        self.register_buffer("var", torch.ones(16))

    def forward(self, x):
        y = F.batch_norm(self.conv(x), self.mean, self.var, self.g * 2, None, False, 0.1, 1e-5)
        return self.out(y).mean((2, 3))


def prune(model, x=X, ratio=0.5):
    return select_filters(model, x, ratio)


NORMS = {"BatchNormAct": (lambda: BatchNormAct(16), "BatchNormalization"),
         "GroupNormAct": (lambda: GroupNormAct(4, 16), "GroupNormalization"),
         "LayerNorm2d": (lambda: LayerNorm2d(16), "LayerNormalization")}


@pytest.mark.parametrize("kind", list(NORMS))
def test_norm_module_calling_the_functional_norm_follows_the_channels(kind):
    torch.manual_seed(0)
    make, op_type = NORMS[kind]
    original = Net(make()).eval()
    model = copy.deepcopy(original)
    groups, blocked = prune(model)
    (g,) = groups
    assert [m.name for m in g.producers] == ["conv1"] and [m.name for m in g.consumers] == ["conv2"]
    assert {m.name: m.op_type for m in g.passive} == {"norm": op_type}
    assert [b.producers for b in blocked] == [["conv2"]]  # the graph output only
    assert len(g.removed) == 8
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    apply_removal(model, groups)
    keep = [c for c in range(16) if c not in g.removed]
    for name, t in original.norm.state_dict().items():
        if t.dim() == 1:  # weight, bias, running statistics: the kept channels, in order
            assert torch.equal(model.norm.state_dict()[name], t[keep]), name
    with torch.no_grad():  # the smaller model computes what the norm computes on the kept channels
        y = original.conv1(X)[:, keep]
        ref = F.conv2d(model.norm(y), original.conv2.weight[:, keep], original.conv2.bias).mean((2, 3))
        assert torch.allclose(model(X), ref, atol=1e-5)
    fresh = copy.deepcopy(original)  # the record replays the same removal
    apply_removal(fresh, groups_from_records(record, fresh))
    a, b = model.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_norm_module_called_twice_blocks():
    groups, blocked = prune(TwiceNet().eval())
    assert groups == []
    (b,) = [b for b in blocked if "a" in b.producers]
    assert "the parameters of 'norm' are read by more than this batch_norm" in b.reason


def test_functional_norm_with_a_computed_weight_blocks():
    groups, blocked = prune(ComputedWeightNet().eval())
    assert groups == []
    (b,) = [b for b in blocked if b.producers == ["conv"]]
    assert b.at == "batch_norm_0" and "not the parameters of one norm module" in b.reason


def test_layer_norm_subclass_that_moves_the_channels_blocks():
    groups, blocked = prune(Net(FlippedLayerNorm2d(16)).eval())
    assert groups == []
    (b,) = [b for b in blocked if b.producers == ["conv1"]]
    assert b.at == "norm" and "normalises over (16,), not only the channel axis 1" in b.reason


def test_scalar_module_working_per_channel_passes_the_channels_on():
    torch.manual_seed(0)
    model = Net(Affine()).eval()
    groups, _ = prune(model)
    (g,) = groups
    assert [m.name for m in g.consumers] == ["conv2"] and g.passive == []  # nothing of Affine is sliced
    apply_removal(model, groups)
    assert model.conv1.out_channels == 8 and model(X).shape == (2, 8)


def test_scalar_module_mixing_the_channels_blocks():
    groups, blocked = prune(Net(ScaledSoftmax()).eval())
    assert groups == []
    (b,) = [b for b in blocked if b.producers == ["conv1"]]
    assert b.at == "norm" and "uses the channels in a way filter pruning cannot follow" in b.reason


def test_vector_the_module_reshapes_itself_is_sliced_with_the_channels():
    torch.manual_seed(0)
    original = Net(LayerScale2d(16)).eval()
    model = copy.deepcopy(original)
    groups, _ = prune(model)
    (g,) = groups
    assert {m.name: m.op_type for m in g.passive} == {"norm": "ChannelParams"}
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    apply_removal(model, groups)
    keep = [c for c in range(16) if c not in g.removed]
    assert torch.equal(model.norm.gamma, original.norm.gamma[keep]) and model(X).shape == (2, 8)
    fresh = copy.deepcopy(original)
    apply_removal(fresh, groups_from_records(record, fresh))
    assert torch.equal(fresh.norm.gamma, model.norm.gamma)


def test_vector_module_moving_the_channels_blocks():
    groups, blocked = prune(Net(ScaleThenFlip(16)).eval())
    assert groups == []
    (b,) = [b for b in blocked if b.producers == ["conv1"]]
    assert b.at == "norm" and "'gamma' (16,) is not one value per channel" in b.reason


class LinearNorm(nn.Module):
    """LeViT's Linear + BatchNorm1d over the tokens: ``bn(x.flatten(0, 1)).reshape_as(x)``."""

    def __init__(self, a, b):
        super().__init__()
        self.linear, self.bn = nn.Linear(a, b), nn.BatchNorm1d(b)

    def forward(self, x):
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class TokenNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = LinearNorm(8, 16), LinearNorm(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).mean(1)


def test_reshape_as_a_tracked_tensor_follows_and_couples_the_channels():
    torch.manual_seed(0)
    model, tokens = TokenNormNet().eval(), torch.randn(2, 5, 8)
    groups, blocked = prune(model, tokens)
    (g,) = groups
    assert [m.name for m in g.producers] == ["a.linear"] and [m.name for m in g.consumers] == ["b.linear"]
    assert {m.name for m in g.passive if not m.is_function} == {"a.bn"}
    assert [b.producers for b in blocked] == [["b.linear"]]  # the graph output only
    apply_removal(model, groups)
    assert model.a.bn.num_features == 8 and model(tokens).shape == (2, 4)


class ReshapedGammaNet(nn.Module):
    """timm's ConvNeXt block: ``x.mul(gamma.reshape(1, -1, 1, 1))`` in the forward of a module
    that is not a leaf (the reshape and mul are graph ops)."""

    def __init__(self, twice=False):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 8, 1)
        self.gamma, self.twice = nn.Parameter(torch.rand(16) + 0.5), twice

    def forward(self, x):
        y = self.conv1(x).mul(self.gamma.reshape(1, -1, 1, 1))
        if self.twice:  # the same parameter read again: slicing it would change the other read
            y = y + self.gamma.reshape(1, -1, 1, 1)
        return self.conv2(y).mean((2, 3))


def test_parameter_reshaped_in_the_forward_is_sliced_with_the_channels():
    torch.manual_seed(0)
    original = ReshapedGammaNet().eval()
    model = copy.deepcopy(original)
    groups, _ = prune(model)
    (g,) = groups
    assert {m.name: m.op_type for m in g.passive if not m.is_function} == {"gamma": "Parameter"}
    apply_removal(model, groups)
    keep = [c for c in range(16) if c not in g.removed]
    assert torch.equal(model.gamma, original.gamma[keep]) and model(X).shape == (2, 8)


def test_parameter_reshaped_twice_blocks():
    groups, blocked = prune(ReshapedGammaNet(twice=True).eval())
    assert groups == []
    (b,) = [b for b in blocked if b.producers == ["conv1"]]
    assert b.at == "mul_0" and "parameter 'gamma' holds one value per channel but is read by 2 ops" in b.reason
