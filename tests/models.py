"""Test model zoo: small models that each exercise one graph pattern compression must handle.

Import as ``from tests.models import Net001, INPUT_SHAPES``. ``INPUT_SHAPES`` gives each
model's example input, ``OUTPUT_SHAPES`` the output that input produces. Run models in
eval mode for single-sample inputs (``Net001`` has BatchNorm1d, which refuses batch 1
in train mode). Module names are part of the contract: configs and records name them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _cbr(c_in: int, c_out: int, k: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """Sequential(Conv2d, BatchNorm2d, ReLU): conv is ``<name>.0``, BN ``<name>.1``."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class Net001(nn.Module):
    """Upstream AMCT's test model that most compat configs target; input (1, 2, 28, 28).

    Plain, depthwise (layer3/4) and group (layer5/6) convs, then an fc stack with
    BatchNorm1d. 28 -> 26 -> 24 -> 22 -> 20 -> 18 -> 16 spatially, so fc.0 sees 8*16*16.
    """

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(2, 16, 3, bias=False), nn.BatchNorm2d(16))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 16, 3), nn.BatchNorm2d(16), nn.ReLU())
        self.layer3 = nn.Sequential(nn.Conv2d(16, 16, 3, groups=16), nn.BatchNorm2d(16))
        self.layer4 = nn.Sequential(nn.Conv2d(16, 16, 3, groups=16), nn.BatchNorm2d(16), nn.ReLU())
        self.avg_pool = nn.AvgPool2d(1, 1)
        self.layer5 = nn.Sequential(nn.Conv2d(16, 32, 3, groups=4), nn.BatchNorm2d(32))
        self.layer6 = nn.Sequential(nn.Conv2d(32, 8, 3, groups=8), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Sequential(
            nn.Linear(8 * 16 * 16, 1024),
            nn.BatchNorm1d(1024),
            nn.Linear(1024, 128, bias=False),
            nn.BatchNorm1d(128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )

    def forward(self, x):
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.layer6(self.layer5(self.avg_pool(x)))
        return self.fc(torch.flatten(x, 1))


class ResBlockNet(nn.Module):
    """Stem conv, then one ResNet basic block whose output is ``relu(bn2(conv2(..)) + x)``.

    The residual add ties stem.0, block_conv2 and the add's consumers into one channel
    group: pruning one of them must prune the others identically.
    """

    def __init__(self, c: int = 16, num_classes: int = 10):
        super().__init__()
        self.stem = _cbr(3, c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.head = nn.Conv2d(c, 32, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.stem(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)) + x)
        return self.fc(torch.flatten(self.pool(self.head(out)), 1))


class ConcatNet(nn.Module):
    """Two conv branches (8 + 8 channels) concatenated on channels, then ``conv`` (16 -> 16).

    Pruning a branch removes its slice of ``conv``'s input channels at the right offset.
    """

    def __init__(self):
        super().__init__()
        self.branch1 = _cbr(3, 8, k=3)
        self.branch2 = _cbr(3, 8, k=1)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return self.conv(torch.cat([self.branch1(x), self.branch2(x)], dim=1))


class DepthwiseSeparableNet(nn.Module):
    """conv -> depthwise conv + BN + ReLU -> pointwise conv.

    A depthwise conv passes channels through: pruning ``conv.0``'s outputs must prune
    ``dw.0`` (weights and groups) and ``pw``'s inputs together.
    """

    def __init__(self):
        super().__init__()
        self.conv = _cbr(3, 16)
        self.dw = _cbr(16, 16, groups=16)
        self.pw = nn.Conv2d(16, 32, 1)

    def forward(self, x):
        return self.pw(self.dw(self.conv(x)))


class PoolFlattenLinearNet(nn.Module):
    """conv -> global average pool -> flatten -> Linear: pruned conv channels map 1:1 to fc inputs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.flatten(self.pool(self.relu(self.conv(x)))))


class TinyTransformerBlock(nn.Module):
    """Pre-LN transformer block written out by hand; input and output [B, T, d].

    q/k/v/out_proj and fc1/fc2 are the Linear layers a quantizer targets; the attention
    matmuls, reshape/transpose and softmax are plain tensor ops between them.
    """

    def __init__(self, d: int = 32, heads: int = 4, hidden: int = 64):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def _split(self, t):  # [B, T, d] -> [B, heads, T, d/heads]
        b, n, d = t.shape
        return t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x):
        b, n, d = x.shape
        h = self.ln1(x)
        q, k, v = self._split(self.q_proj(h)), self._split(self.k_proj(h)), self._split(self.v_proj(h))
        attn = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.out_proj((attn @ v).transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand + ReLU6, 3x3 depthwise + ReLU6, 1x1 linear project."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int):
        super().__init__()
        hidden = c_in * expand
        self.use_res = stride == 1 and c_in == c_out
        self.conv = nn.Sequential(
            nn.Conv2d(c_in, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2Tiny(nn.Module):
    """Stem, three inverted residual blocks (two with residual adds), 1x1 head, classifier.

    ``features.1`` and ``features.3`` add their input (shapes match); ``features.2``
    has stride 2 and changes width, so no add.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(inplace=True)),
            InvertedResidual(16, 16, 1, 4),
            InvertedResidual(16, 24, 2, 4),
            InvertedResidual(24, 24, 1, 4),
            nn.Sequential(nn.Conv2d(24, 64, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU6(inplace=True)),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class UNetTiny(nn.Module):
    """Two-level U-Net: encoder, max-pool, bottleneck, ConvTranspose2d up, concat skip, decoder.

    ``up`` is a ConvTranspose2d, whose weight is [in, out, kH, kW] (output channels on
    axis 1, not 0); the decoder's input is the concat [up, enc1].
    """

    def __init__(self, out_channels: int = 2):
        super().__init__()
        self.enc1 = _cbr(3, 16)
        self.pool = nn.MaxPool2d(2)
        self.enc2 = _cbr(16, 32)
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.dec = _cbr(32, 16)
        self.head = nn.Conv2d(16, out_channels, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        u = self.up(self.enc2(self.pool(e1)))
        return self.head(self.dec(torch.cat([u, e1], dim=1)))


class EltwiseGroupNet(nn.Module):
    """Two group convs (groups=2, 160 outputs each) merged by an add, then a groups=2 consumer.

    The add joins layer1.0 and layer2.0 into one prune group (as in upstream's
    record_EltwiseConv.txt); groups=2 means channels are kept per group, so pruning
    0.25 keeps 60 per group = 120 of 160 in both producers and the consumer's input.
    """

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(16, 160, 3, padding=1, groups=2), nn.BatchNorm2d(160))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 160, 3, padding=1, groups=2), nn.BatchNorm2d(160))
        self.relu = nn.ReLU()
        self.layer3 = nn.Sequential(nn.Conv2d(160, 32, 3, padding=1, groups=2), nn.BatchNorm2d(32))

    def forward(self, x):
        return self.layer3(self.relu(self.layer1(x) + self.layer2(x)))


class ReusedModuleNet(nn.Module):
    """One Conv2d module (``shared``) called twice in forward.

    A module that runs at two graph positions: its quant/prune state must be shared (or
    the tool must refuse it clearly); hooks fire twice per forward.
    """

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.shared = nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.stem(x))
        return self.shared(self.relu(self.shared(x)))


class SharedWeightNet(nn.Module):
    """Two Linear modules whose ``weight`` is the same Parameter (tied weights).

    ``named_parameters()`` lists it once (as ``fc1.weight``); ``state_dict()`` has both
    keys. Pruning or quantizing one layer changes the other.
    """

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.fc2.weight = self.fc1.weight
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


class UntraceableNet(nn.Module):
    """Python control flow on a tensor *value*: ``if x.sum() > 0`` picks ``conv_pos`` or ``conv_neg``.

    What it shows: ``torch.fx.symbolic_trace`` raises (a Proxy cannot be turned into a
    bool), ``torch.jit.trace`` / ONNX export silently bake in the branch the example input
    took, and eager hooks see only the branch that ran. A compression tool must either
    fall back to a capture that copes (e.g. eager module hooks) or refuse with a clear
    error naming the model, never produce a graph that is only right for one input.
    Both branches map 3 -> 8 channels, so output shape is the same either way.
    """

    def __init__(self):
        super().__init__()
        self.conv_pos = nn.Conv2d(3, 8, 3, padding=1)
        self.conv_neg = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        if x.sum() > 0:
            y = self.conv_pos(x)
        else:
            y = self.conv_neg(x)
        return self.head(torch.relu(y))


INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "Net001": (1, 2, 28, 28),
    "ResBlockNet": (1, 3, 16, 16),
    "ConcatNet": (1, 3, 16, 16),
    "DepthwiseSeparableNet": (1, 3, 16, 16),
    "PoolFlattenLinearNet": (1, 3, 16, 16),
    "TinyTransformerBlock": (2, 8, 32),
    "MobileNetV2Tiny": (1, 3, 32, 32),
    "UNetTiny": (1, 3, 32, 32),
    "EltwiseGroupNet": (1, 16, 8, 8),
    "ReusedModuleNet": (1, 3, 16, 16),
    "SharedWeightNet": (4, 16),
    "UntraceableNet": (1, 3, 16, 16),
}

OUTPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "Net001": (1, 10),
    "ResBlockNet": (1, 10),
    "ConcatNet": (1, 16, 16, 16),
    "DepthwiseSeparableNet": (1, 32, 16, 16),
    "PoolFlattenLinearNet": (1, 10),
    "TinyTransformerBlock": (2, 8, 32),
    "MobileNetV2Tiny": (1, 10),
    "UNetTiny": (1, 2, 32, 32),
    "EltwiseGroupNet": (1, 32, 8, 8),
    "ReusedModuleNet": (1, 8, 16, 16),
    "SharedWeightNet": (4, 16),
    "UntraceableNet": (1, 8, 16, 16),
}

MODELS: dict[str, type[nn.Module]] = {
    cls.__name__: cls
    for cls in (
        Net001,
        ResBlockNet,
        ConcatNet,
        DepthwiseSeparableNet,
        PoolFlattenLinearNet,
        TinyTransformerBlock,
        MobileNetV2Tiny,
        UNetTiny,
        EltwiseGroupNet,
        ReusedModuleNet,
        SharedWeightNet,
        UntraceableNet,
    )
}


def example_input(name: str, seed: int = 0) -> torch.Tensor:
    """A reproducible random input of ``INPUT_SHAPES[name]`` (own generator, global RNG untouched)."""
    return torch.randn(INPUT_SHAPES[name], generator=torch.Generator().manual_seed(seed))


class TwoConvNet(nn.Module):
    """conv1 (3 -> 8) -> ReLU -> conv2 (8 -> 4) = the model output: under filter pruning conv1 can
    lose channels, conv2 cannot (its channels are the output). MACs and parameters are easy to
    count by hand. Not in ``MODELS``: used by name (``tests.models:TwoConvNet``)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1, bias=False)

    def forward(self, x):
        return self.conv2(self.relu(self.conv1(x)))


def spread_bn_scales(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with its BatchNorm2d scales drawn from [0.5, 2] and no biases
    changed: the deploy file's int32 biases are then exact, so deploy and fake-quant compare
    to float noise."""
    with torch.no_grad():
        for b in model.modules():
            if isinstance(b, nn.BatchNorm2d):
                b.weight.uniform_(0.5, 2.0)
    return model.eval()
