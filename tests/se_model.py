"""A small EfficientNet-like classifier for 1x28x28 digits: SiLU after every conv, a TF-style
zero pad before the strided depthwise conv, squeeze-excitation (pool, reduce, SiLU, expand,
Sigmoid, multiply) and a residual add: the ops activation quantization quantizes between
layers."""

from __future__ import annotations

import torch
from torch import nn


class SqueezeExcite(nn.Module):
    def __init__(self, ch: int, reduced: int) -> None:
        super().__init__()
        self.squeeze = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(ch, reduced, 1)
        self.act_reduce = nn.SiLU()
        self.expand = nn.Conv2d(reduced, ch, 1)
        self.act_expand = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.act_expand(self.expand(self.act_reduce(self.reduce(self.squeeze(x)))))
        return torch.mul(x, s)


class MBBlock(nn.Module):
    """Expand 1x1 -> (TF pad) depthwise 3x3 -> SE -> project 1x1 (+ residual when shapes match)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int = 4) -> None:
        super().__init__()
        mid = cin * expand
        self.expand_conv = nn.Conv2d(cin, mid, 1, bias=False)
        self.expand_bn = nn.BatchNorm2d(mid)
        self.expand_act = nn.SiLU()
        # HF EfficientNet's "same" padding for stride 2: pad right/bottom only, then padding=0
        self.pad = nn.ZeroPad2d((0, 1, 0, 1)) if stride == 2 else nn.Identity()
        self.dw = nn.Conv2d(mid, mid, 3, stride, padding=0 if stride == 2 else 1, groups=mid, bias=False)
        self.dw_bn = nn.BatchNorm2d(mid)
        self.dw_act = nn.SiLU()
        self.se = SqueezeExcite(mid, max(4, cin // 2))
        self.project = nn.Conv2d(mid, cout, 1, bias=False)
        self.project_bn = nn.BatchNorm2d(cout)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.expand_act(self.expand_bn(self.expand_conv(x)))
        y = self.dw_act(self.dw_bn(self.dw(self.pad(y))))
        y = self.project_bn(self.project(self.se(y)))
        return x + y if self.residual else y


class SENet(nn.Module):
    def __init__(self, classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, 1, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(width)
        self.stem_act = nn.SiLU()
        self.blocks = nn.Sequential(MBBlock(width, 2 * width, 2), MBBlock(2 * width, 2 * width, 1),
                                    MBBlock(2 * width, 4 * width, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(self.stem_act(self.stem_bn(self.stem(x))))
        return self.fc(torch.flatten(self.pool(y), 1))
