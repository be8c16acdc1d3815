"""Model size figures shown by inspect, report and the demo: parameters and MACs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from openamct.graph.capture import split_input_data
from openamct.layer_types import features, layer_type_of


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, input_data: Any) -> int:
    """Multiply-accumulates of conv and linear layers for one forward of ``input_data``."""
    total = 0

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        w = getattr(module, "weight", None)
        if w is None or not isinstance(output, torch.Tensor):
            return
        row = layer_type_of(module)
        if row.matrix:
            total += output.numel() * features(module)[0]
        elif row.transposed:
            total += inputs[0].numel() * w[0].numel()
        else:
            total += output.numel() * w[0].numel()

    handles = [m.register_forward_hook(hook) for m in model.modules() if layer_type_of(m) is not None]
    was_training = model.training
    args, kwargs = split_input_data(input_data)
    try:
        model.eval()
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return total
