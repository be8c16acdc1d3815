"""The examples' and tests' digits: scikit-learn's 1,797 real 8x8 digits and the small nets that
classify them in a few seconds an epoch (the demo itself uses MNIST 5k and ``MnistNet``).

Importable as ``examples.digits`` with the repository root on ``sys.path`` (the example scripts
put it there; pytest runs from it).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from openamct.demo.data import DataSplit, check_split_args, split_images
from openamct.demo.models import conv_bn_relu

logger = logging.getLogger(__name__)

__all__ = ["DigitsConvMLP", "DigitsNet", "load_digits"]


def load_digits(test_fraction: float = 0.25, seed: int = 0, normalize: bool = False) -> DataSplit:
    """scikit-learn's bundled 1,797 real 8x8 digits as float32 ``N x 1 x 8 x 8``.

    Pixels are ``value / 16`` in [0, 1] (not standardised unless ``normalize``);
    labels int64 in 0..9. Same stratified, seeded split as ``openamct.demo.data.load_mnist_5k``.
    """
    check_split_args(test_fraction, seed)
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "load_digits needs scikit-learn, which bundles the 8x8 digits: pip install scikit-learn"
        ) from exc
    bunch = _sk_load_digits()
    images = (bunch.images.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    split = split_images(images, np.asarray(bunch.target), test_fraction, seed, normalize)
    logger.debug("load_digits: %r", split)
    return split


class DigitsNet(nn.Module):
    """The examples' CNN for scikit-learn's 1 x 8 x 8 digits -> 10 logits (a few seconds an epoch).

    Convs are ``conv1.0``, ``conv2.0``, ``conv3.0`` (each followed by its BN and ReLU), the
    classifier is ``head.2``: the names the configs in ``examples/`` use.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = conv_bn_relu(1, 32)
        self.conv2 = conv_bn_relu(32, 64)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = conv_bn_relu(64, 64)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv3(self.pool(self.conv2(self.conv1(x)))))


class DigitsConvMLP(nn.Module):
    """The DDP example's and test's net for 1 x 8 x 8 digits: two conv-BN-ReLU (``conv1.0``,
    ``conv2.0``), 2 x 2 average pooling, then two Linear (``fc1``, ``fc2``)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc1 = nn.Linear(128, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.conv2(self.conv1(x))).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))
