"""The demo's CNN, written by hand (torchvision's wheel does not import on this platform).

Module names follow the AMCT configs' convention (``layer1.0`` for a conv, ``layer1.1`` for its
BN), because users write such names in configs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["MnistNet", "conv_bn_relu"]


def conv_bn_relu(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class MnistNet(nn.Module):
    """The demo CNN for 1 x 28 x 28 digits -> 10 logits.

    ``layer1``..``layer4`` are Sequential(conv 3x3, BN, ReLU), so the convs are named
    ``layer1.0``..``layer4.0`` and their BNs ``layer{i}.1`` (the naming AMCT configs
    use). ``maxpool`` sits after ``layer2``; ``layer4`` has stride 2 (28 -> 14 -> 7);
    then global average pooling and ``fc``. Default widths (``WIDTHS``) are multiples of
    16 so 25 / 50 % channel pruning keeps aligned widths; 98.7 k parameters, about
    11 M MACs per image (widths 32/64/64/128 cost ~2.3x the MACs, which does not fit
    the demo's ~60 s training budget on 2 cores).

    Measured with ``openamct.demo.train.train_mnist`` (15 epochs, Adam 3e-3 cosine,
    batch 32, +-2 px shifts) on ``load_mnist_5k()`` (4,000 train / 1,000 test):
    98.4-98.9 % test accuracy over five seeds, ~33 s wall on 2 idle CPU cores
    (torch 2.13, ~57 s of CPU time on one thread).
    """

    WIDTHS = (16, 32, 64, 128)

    def __init__(self, num_classes: int = 10, widths: tuple[int, ...] = WIDTHS):
        super().__init__()
        if len(widths) != 4 or any(int(w) < 1 for w in widths):
            raise ValueError(f"widths must be 4 positive ints, got {widths!r}")
        w1, w2, w3, w4 = (int(w) for w in widths)
        self.layer1 = conv_bn_relu(1, w1)
        self.layer2 = conv_bn_relu(w1, w2)
        self.maxpool = nn.MaxPool2d(2)
        self.layer3 = conv_bn_relu(w2, w3)
        self.layer4 = conv_bn_relu(w3, w4, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(w4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.layer2(self.layer1(x)))
        x = self.layer4(self.layer3(x))
        return self.fc(self.flatten(self.avgpool(x)))
