"""HF EfficientNet's pooler, ``AvgPool2d(1280, ceil_mode=True)`` on a 7x7 map, is a global
average pool spelled as a window larger than its input. Exported as torch writes it, OpenVINO
refuses the file and ORT's QLinearAveragePool mis-averages it (logits 12x too small); as a
GlobalAveragePool both run it, in int8. The export working copies get this form (``fold_pools``);
activation_quant asks ``covers_input`` whether such a pool may read an int8 tensor."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from openamct.module_tree import set_module

__all__ = ["CoveringAvgPool2d", "covers_input", "fold_pools"]


class CoveringAvgPool2d(nn.AvgPool2d):
    """Export form of an ``AvgPool2d``: a GlobalAveragePool where its window covers the whole
    input. Exact: torch divides by the covered H x W, which is the global mean."""

    def forward(self, x: Tensor) -> Tensor:
        if covers_input(self, x.shape):
            return torch.nn.functional.adaptive_avg_pool2d(x, 1)
        return super().forward(x)


def covers_input(pool: nn.Module, shape) -> bool:
    """An AvgPool2d that averages its whole (H, W) input into one value per channel."""
    k = pool.kernel_size if isinstance(pool.kernel_size, tuple) else (pool.kernel_size,) * 2
    pad = pool.padding if isinstance(pool.padding, tuple) else (pool.padding,) * 2
    return (type(pool) in (nn.AvgPool2d, CoveringAvgPool2d) and len(shape) == 4 and all(p == 0 for p in pad)
            and pool.divisor_override is None and int(shape[-2]) <= k[0] and int(shape[-1]) <= k[1]
            and (pool.ceil_mode or (int(shape[-2]), int(shape[-1])) == tuple(k)))


def fold_pools(model: nn.Module) -> int:
    """Give every plain ``AvgPool2d`` of ``model`` (a working copy) its export form."""
    found = [(n, m) for n, m in model.named_modules() if type(m) is nn.AvgPool2d]
    for name, m in found:
        pool = CoveringAvgPool2d(m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad,
                                 m.divisor_override)
        set_module(model, name, pool.train(m.training))
    return len(found)
