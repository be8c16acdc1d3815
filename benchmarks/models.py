"""The benchmarks' models, written by hand (torchvision's wheel does not import on this platform).

Module names follow torchvision (``conv1``, ``bn1``, ``layer1.0.conv1``,
``layer1.0.downsample.0``, ``fc``) because users write such names in configs.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "MLPBlock", "MLPStack", "ResNet", "mlp", "resnet18", "resnet_depth",
           "resnet_with_conv_layers"]


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock (same attribute names)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet of BasicBlocks with torchvision's module names.

    Stage ``i`` (``layer{i+1}``) has ``widths[i]`` channels; every stage after the
    first starts with a stride-2 block. ``stem="imagenet"``: 7x7/2 conv + 3x3/2
    max-pool; ``stem="cifar"``: 3x3/1 conv and ``maxpool`` is an ``nn.Identity`` (kept
    so both layouts have the same names).
    """

    def __init__(
        self,
        blocks_per_stage: list[int],
        widths: list[int],
        num_classes: int = 1000,
        stem: str = "imagenet",
        in_channels: int = 3,
    ):
        super().__init__()
        if len(blocks_per_stage) != len(widths) or not blocks_per_stage:
            raise ValueError(
                f"blocks_per_stage {blocks_per_stage!r} and widths {widths!r} must be non-empty "
                "and equally long"
            )
        if any(int(n) < 1 for n in blocks_per_stage):
            raise ValueError(f"blocks_per_stage must be positive ints, got {blocks_per_stage!r}")
        if stem not in ("imagenet", "cifar"):
            raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
        self.inplanes = widths[0]
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, self.inplanes, 7, stride=2, padding=3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        else:
            self.conv1 = nn.Conv2d(in_channels, self.inplanes, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.num_stages = len(widths)
        for i, (n, width) in enumerate(zip(blocks_per_stage, widths, strict=True)):
            setattr(self, f"layer{i + 1}", self._make_layer(int(width), int(n), 1 if i == 0 else 2))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(self.inplanes, num_classes)
        # torchvision's initialisation, so trained-from-scratch behaviour matches.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, planes: int, n_blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(n_blocks - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000, cifar_stem: bool = False) -> ResNet:
    """ResNet-18 (BasicBlock x [2, 2, 2, 2], widths 64..512): 20 Conv2d + 1 Linear.

    With ``num_classes=1000`` it has torchvision's 11,689,512 parameters and the same
    state_dict keys. ``cifar_stem``: 3x3 stride-1 first conv and no max-pool (for 32x32).
    """
    return ResNet([2, 2, 2, 2], [64, 128, 256, 512], num_classes, "cifar" if cifar_stem else "imagenet")


def resnet_depth(n_blocks_per_stage: list[int], width: int = 16, num_classes: int = 10) -> ResNet:
    """CIFAR-style ResNet (3x3 stem, no max-pool), stage ``i`` has ``width * 2**i`` channels.

    Conv2d count = 1 (stem) + 2 * sum(n_blocks_per_stage) + (len(n_blocks_per_stage) - 1),
    the last term being the 1x1 downsample convs that open every stage after the first.
    Input 3 x H x W (H, W divisible by ``2**(stages-1)``, e.g. 32 x 32).
    """
    if not isinstance(n_blocks_per_stage, (list, tuple)) or not n_blocks_per_stage:
        raise ValueError(f"n_blocks_per_stage must be a non-empty list, got {n_blocks_per_stage!r}")
    if int(width) < 1:
        raise ValueError(f"width must be a positive int, got {width!r}")
    widths = [int(width) * 2**i for i in range(len(n_blocks_per_stage))]
    return ResNet(list(n_blocks_per_stage), widths, num_classes, stem="cifar")


def resnet_with_conv_layers(n: int, width: int = 16, num_classes: int = 10) -> ResNet:
    """A two-stage :func:`resnet_depth` with exactly ``n`` Conv2d layers (and one Linear).

    Two stages give 1 stem conv + 1 downsample conv + 2 per block, so
    ``n = 2 + 2 * blocks``: 18 -> 8 blocks ([4, 4]), 66 -> 32 ([16, 16]),
    258 -> 128 ([64, 64]; the 128-block stack of the platform's graph-capture
    measurements). Any even ``n >= 6`` works; the odd block goes to the first stage.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 6 or n % 2:
        raise ValueError(f"n (conv layer count) must be an even int >= 6, got {n!r}")
    blocks = (n - 2) // 2
    return resnet_depth([blocks - blocks // 2, blocks // 2], width, num_classes)


class MLPBlock(nn.Module):
    """Transformer MLP sub-layer, post-LN: ``norm(x + fc2(gelu(fc1(x))))``."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


class MLPStack(nn.Module):
    """``layers`` MLP blocks (``layers.{i}.fc1`` / ``.fc2`` / ``.norm``); input and output [B, T, d]."""

    def __init__(self, layers: int, d: int, hidden: int):
        super().__init__()
        self.layers = nn.Sequential(*(MLPBlock(d, hidden) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def mlp(layers: int = 6, d: int = 768, hidden: int = 3072) -> MLPStack:
    """BERT-base-sized MLP stack (the platform notes' 6-layer 768/3072 INT8 benchmark)."""
    for name, value in (("layers", layers), ("d", d), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return MLPStack(layers, d, hidden)
