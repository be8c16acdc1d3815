"""Where the modules openamct adds to a model live: on the device of the weights they serve."""

from __future__ import annotations

from torch import nn

from openamct.training.rollback import stateful_modules

__all__ = ["place_added_modules"]


def place_added_modules(work: nn.Module, layers: dict[str, nn.Module]) -> None:
    """Move every module a technique added (quantizers, observers, sparsifiers, masks; see
    ``rollback.stateful_modules``) to the device of the weights it serves: each layer's parts
    to its weight's, the others to the model's parameters' when they share one device. They
    are built on the CPU; a CUDA model's first training forward would fail, and DDP refuses a
    model whose tensors are on several devices."""
    devices = {p.device for p in work.parameters()}
    home = devices.pop() if len(devices) == 1 else None
    for layer in layers.values():
        device = next(layer.parameters(recurse=False)).device  # the weight's (an LSTM's first weight)
        for part in layer.children():
            part.to(device)
    for m, _ in stateful_modules(work, {}):
        if home is not None:
            m.to(home)
