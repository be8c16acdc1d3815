"""A Linear whose owner calls ``F.linear(x, self.lin.weight, self.lin.bias)`` instead of
``self.lin(x)`` (torchvision Swin's ``shifted_window_attention`` does this for ``qkv`` and
``proj``): route that call to the layer that replaced the Linear.

Why: the compressed layer replaces the ``nn.Linear`` as usual, but the owner never calls it;
it reads the layer's weight and bias and calls the function itself, so the layer's quantizers
and masks would never run. ``self.lin.weight`` still resolves to the raw float weight (the
compressed layer keeps the wrapped Linear's parameters), so without routing the model would
silently compute a float Linear.

How: the owner gets a ``ModeHooks`` pair (``quant/matmul.py``, shared with the MatMul input
quantizers) that runs its forward under ``_RouteMode``. The mode counts the ``F.linear`` calls
the owner's own code makes (the graph capture gives exactly these the owner as scope) and calls
``owner.get_submodule(path)(x)`` for the counted positions graph discovery found
(``graph/layers.py``). The layer is looked up at each call, so the export's working copy, whose
compressed layers are replaced by their export form, routes to that form and the ONNX exporter
traces the quantized layer in both files. A compressed layer is checked to be the one whose
weight and bias the call passes (a forward that took another path than the captured one fails
loudly instead of computing something else; the export form, whose weight may be computed on
access, is not checked).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from openamct.compressed.layer import CompressedLayer
from openamct.quant.matmul import ModeHooks, hook_mode, module_of_caller

__all__ = ["attach_routes", "routed_owners"]

ATTR = "_openamct_linear_routes"  # on the owner: ((position, layer path relative to it), ...)


def _arg(args: tuple, kwargs: dict, pos: int, name: str):
    return args[pos] if len(args) > pos else kwargs.get(name)


class _RouteMode(TorchFunctionMode):
    def __init__(self, owner: nn.Module, routes: tuple[tuple[int, str], ...]) -> None:
        super().__init__()
        self.owner, self.routes = owner, dict(routes)
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is F.linear and module_of_caller() is self.owner:
            path = self.routes.get(self.count)
            self.count += 1
            if path is not None:  # (this mode is off while its own __torch_function__ runs)
                layer = self.owner.get_submodule(path)
                if isinstance(layer, CompressedLayer) and not getattr(layer, "_openamct_leaf", False) and (
                        _arg(args, kwargs, 1, "weight") is not layer.weight
                        or _arg(args, kwargs, 2, "bias") is not layer.bias):
                    raise RuntimeError(
                        f"{type(self.owner).__name__}.forward: F.linear call {self.count - 1} no longer reads the "
                        f"weight and bias of {path!r}, as it did when the model was captured (a forward that "
                        "takes another path than with input_data?)")
                return layer(_arg(args, kwargs, 0, "input"))
        return func(*args, **kwargs)


def _route_mode(routes: tuple[tuple[int, str], ...], module: nn.Module) -> _RouteMode:
    return _RouteMode(module, routes)


def attach_routes(owner: nn.Module, routes: Sequence[tuple[int, str]]) -> None:
    """Route the owner's ``F.linear`` call at each ``position`` (among the F.linear calls its
    own code makes in one forward) to its submodule ``path``."""
    if hasattr(owner, ATTR):
        raise ValueError(f"{type(owner).__name__} already routes F.linear calls ({ATTR})")
    frozen = tuple(sorted((int(p), str(path)) for p, path in routes))
    object.__setattr__(owner, ATTR, frozen)  # a tuple: not a module, parameter or buffer
    hook_mode(owner, ModeHooks(partial(_route_mode, frozen)))


def routed_owners(model: nn.Module) -> dict[str, tuple[tuple[int, str], ...]]:
    """Owner module path -> its routes, for every owner ``attach_routes`` hooked."""
    return {n: getattr(m, ATTR) for n, m in model.named_modules() if hasattr(m, ATTR)}
