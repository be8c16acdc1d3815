"""Recurrent models of the HF-free zoo, built from torch modules only: a speech-style tagger
(Conv1d front end -> 2-layer bidirectional GRU -> MLP head over the last step) and a
time-series LSTM (LSTM -> MLP head). Random weights, example inputs as ``{"x": ...}``."""

from __future__ import annotations

import torch
from torch import nn


class ConvGRU(nn.Module):
    """x [B, T, 12] -> Conv1d over time (12 -> 16) -> ReLU -> GRU(16 -> 24, 2 layers,
    bidirectional, batch_first) -> last step -> Linear(48 -> 32) -> ReLU -> Linear(32 -> 10).
    Filter pruning reaches ``head.0`` only: the conv's channels end at the GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.front = nn.Conv1d(12, 16, 3, padding=1)
        self.gru = nn.GRU(16, 24, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        f = torch.relu(self.front(x.transpose(1, 2))).transpose(1, 2)
        y, _ = self.gru(f)
        return self.head(y[:, -1])


class SeriesLSTM(nn.Module):
    """x [T, B, 8] (time-major) -> LSTM(8 -> 32) -> last step -> Linear(32 -> 32) -> ReLU -> Linear(32 -> 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 32)
        self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.head(y[-1])


BUILDERS = {
    "ConvGRU": (ConvGRU, (2, 10, 12)),
    "SeriesLSTM": (SeriesLSTM, (9, 2, 8)),
}


def build(family: str):
    cls, shape = BUILDERS[family]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    return cls(), {"x": torch.randn(*shape, generator=g)}
