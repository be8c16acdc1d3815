"""A small CNN trained on sklearn's real 8x8 digits, shared by the accuracy acceptance tests."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from examples.digits import load_digits
from openamct.demo.train import evaluate, train_epochs


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(64)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(64, 64, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.pool(self.relu(self.bn2(self.conv2(x))))
        x = self.relu(self.bn3(self.conv3(x)))
        return self.fc(torch.flatten(self.gap(x), 1))


@functools.lru_cache(maxsize=1)
def _trained() -> tuple[DigitsNet, float]:
    torch.manual_seed(0)
    data = load_digits()
    model = DigitsNet()
    train_epochs(model, data.x_train, data.y_train, epochs=12, batch_size=32, lr=3e-3, seed=0, progress=False)
    model.eval()
    return model, evaluate(model, data.x_test, data.y_test)


def trained_fp32() -> tuple[DigitsNet, float]:
    """(a fresh copy of the FP32 model, its test accuracy); trained once per test session."""
    model, acc = _trained()
    return copy.deepcopy(model), acc


def retrain(model: nn.Module, epochs: int = 4, lr: float = 1e-3) -> float:
    data = load_digits()
    train_epochs(model, data.x_train, data.y_train, epochs=epochs, batch_size=32, lr=lr, seed=1, progress=False)
    model.eval()
    return evaluate(model, data.x_test, data.y_test)


def digits_data():
    return load_digits()
