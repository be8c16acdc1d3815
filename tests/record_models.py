"""The small models upstream AMCT's sample prune records (tests/fixtures/amct-compat/records/)
describe, layer for layer: shared by the record replay tests and the record fuzzer."""

import torch
import torch.nn.functional as F
from torch import nn


class SingleConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64))
        self.layer2 = nn.Sequential(nn.Conv2d(64, 8, 3))

    def forward(self, x):
        return self.layer2(F.relu(self.layer1(x)))


class EltwiseConv(nn.Module):
    def __init__(self, channels=160):
        super().__init__()
        for i in range(1, 5):
            setattr(self, f"layer{i}", nn.Sequential(nn.Conv2d(4, channels, 3, padding=1, groups=2),
                                                     nn.BatchNorm2d(channels)))
        self.layer5 = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1, groups=2))
        self.layer6 = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1, groups=2))

    def forward(self, x):
        y = self.layer1(x) + self.layer2(x)
        y = y + self.layer3(x)
        y = y + self.layer4(x)
        return self.layer5(y) + self.layer6(y)


class NetTrainBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16))
        self.layer2 = nn.Sequential(nn.Conv2d(3, 4, 3))  # a training-only branch from the input
        self.layer3 = nn.Sequential(nn.Conv2d(16, 8, 3))

    def forward(self, x):
        y = self.layer3(F.relu(self.layer1(x)))
        return y + self.layer2(x)[:, :1, 2:-2, 2:-2].mean() if self.training else y


class SplitConcatConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(3, 8, 1))
        self.layer2_1 = nn.Sequential(nn.Conv2d(4, 160, 3, padding=1, groups=2), nn.BatchNorm2d(160))
        self.layer2_2 = nn.Sequential(nn.Conv2d(4, 80, 3, padding=1, groups=2), nn.BatchNorm2d(80))
        self.layer3 = nn.Sequential(nn.Conv2d(240, 8, 3))

    def forward(self, x):
        a, b = torch.split(self.layer1(x), 4, dim=1)
        return self.layer3(torch.cat([self.layer2_1(a), self.layer2_2(b)], 1))

