"""Distillation groups: which blocks train together, and the hooks that feed and read them.

A group runs from the input of its first block to the output of its last one. Blocks are found
automatically as the units between residual joins: the repeated children of a
``Sequential``/``ModuleList`` (a ResNet's BasicBlocks, a transformer's encoder layers, whose
residual adds happen inside them), or, in a model without such a list, the top-level children
that hold compressible layers. A wrapper with a single such child (a ``SentenceEncoder`` around
a ``BertModel`` around its encoder) is looked through. ``group_size`` consecutive blocks make a
group.

While training, the student's first block of each group gets the teacher's input to that block
(its first tensor argument), so every group learns to map the teacher's input to the teacher's
output on its own, all in one forward of the whole model; no gradient crosses a group border.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from openamct.layer_types import layer_type_of

__all__ = ["find_blocks", "unit_blocks", "chunk", "check_groups", "Taps", "first_tensor"]

_CONTAINERS = (nn.Sequential, nn.ModuleList)


def _compressible(m: nn.Module) -> bool:
    return any(layer_type_of(s) is not None for s in m.modules())


def _is_layer(m: nn.Module) -> bool:
    return layer_type_of(m) is not None


def _expand(module: nn.Module, prefix: str) -> list[str]:
    kids = [(f"{prefix}{n}", c) for n, c in module.named_children() if _compressible(c)]
    if len(kids) == 1 and not _is_layer(kids[0][1]) and not isinstance(kids[0][1], _CONTAINERS):
        return _expand(kids[0][1], kids[0][0] + ".")
    out: list[str] = []
    for name, child in kids:
        inner = [(f"{name}.{n}", c) for n, c in child.named_children() if _compressible(c)]
        # A list of blocks (none of them a bare layer) is flattened into its blocks; a
        # Sequential(conv, bn, relu) is one block: its conv alone ends before the BN.
        if isinstance(child, _CONTAINERS) and len(inner) > 1 and not any(_is_layer(c) for _, c in inner):
            for n, c in inner:
                out += _expand_list(c, n)
        else:
            out.append(name)
    return out


def _expand_list(module: nn.Module, name: str) -> list[str]:
    if isinstance(module, _CONTAINERS):
        inner = [(f"{name}.{n}", c) for n, c in module.named_children() if _compressible(c)]
        if inner and not any(_is_layer(c) for _, c in inner):
            return [b for n, c in inner for b in _expand_list(c, n)]
    return [name]


def find_blocks(model: nn.Module) -> list[str]:
    """The model's blocks in module order (names from ``named_modules``); ``[""]`` (the whole
    model) when nothing splits it."""
    blocks = _expand(model, "")
    return blocks or [""]


# Upstream's distillation unit: a layer, then its BatchNorm2d, then an activation, each the one
# reader of the one before (its ``_get_distill_unit`` and capacity table).
_UNIT_BN = ("BatchNorm2d",)
_UNIT_ACTIVATIONS = ("ReLU", "LeakyReLU", "Sigmoid", "Tanh", "Softmax")


def _only_reader(graph, name: str, ops: tuple[str, ...]) -> str | None:
    """The module (of a class in ``ops``, called once) that alone reads ``name``'s one output."""
    node = graph.call_of(name)
    if node is None or len(node.outputs) != 1 or graph.is_output(node.outputs[0]):
        return None
    readers = node.outputs[0].consumers
    if len(readers) != 1 or readers[0].kind != "module" or readers[0].op not in ops:
        return None
    return readers[0].name if len(graph.module_calls.get(readers[0].name, [])) == 1 else None


def unit_blocks(blocks: Sequence[str], model: nn.Module, graph) -> list[list[str]]:
    """Each block as a group's module list; a block that is a bare layer takes the BatchNorm and
    activation modules that follow it alone, as upstream's automatic groups list them
    (``["conv1", "bn1", "relu"]``), so the group ends after the activation."""
    mods = dict(model.named_modules())
    out = []
    for b in blocks:
        unit = [b]
        if b and _is_layer(mods[b]):
            bn = _only_reader(graph, b, _UNIT_BN)
            if bn is not None:
                unit.append(bn)
            act = _only_reader(graph, unit[-1], _UNIT_ACTIVATIONS)
            if act is not None:
                unit.append(act)
        out.append(unit)
    return out


def chunk(blocks: Sequence[Sequence[str]] | Sequence[str], group_size: int) -> list[list[str]]:
    """``group_size`` consecutive blocks per group; a block is a name or a unit (a list of
    names, ``unit_blocks``)."""
    units = [[b] if isinstance(b, str) else list(b) for b in blocks]
    return [[n for u in units[i:i + group_size] for n in u] for i in range(0, len(units), group_size)]


def check_groups(groups: Sequence[Sequence[str]], teacher: nn.Module, student: nn.Module, where: str) -> None:
    """Every name a group gives is a module of both models (ValueError naming it)."""
    t_names = {n for n, _ in teacher.named_modules()}
    s_names = {n for n, _ in student.named_modules()}
    for i, g in enumerate(groups):
        for name in (g[0], g[-1]):
            if name not in t_names:
                raise ValueError(f"{where}: distill_group[{i}] names layer {name!r}, which is not a module of the "
                                 "model (names as model.named_modules() gives them)")
            if name not in s_names:
                raise ValueError(f"{where}: distill_group[{i}] names layer {name!r}, which is not a module of "
                                 "compress_model")


def first_tensor(args: tuple, kwargs: dict) -> tuple[Any, Tensor | None]:
    """(where, tensor) of a call's first tensor argument: an index into args or a kwarg name."""
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            return i, a
    for k, v in kwargs.items():
        if isinstance(v, Tensor):
            return k, v
    return None, None


def _out_tensor(out: Any) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    return getattr(out, "last_hidden_state", None)


class Taps:
    """Forward hooks on one model: per group, the first block's input and the last block's
    output of the current forward. ``feed`` (student only): the inputs to substitute."""

    def __init__(self, model: nn.Module, groups: Sequence[Sequence[str]], feed: bool = False) -> None:
        self.inputs: dict[int, Tensor] = {}
        self.outputs: dict[int, Tensor] = {}
        self.feed: dict[int, Tensor] | None = {} if feed else None
        self._handles = []
        for i, g in enumerate(groups):
            start, end = model.get_submodule(g[0]), model.get_submodule(g[-1])
            self._handles.append(start.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(end.register_forward_hook(self._post(i)))

    def _pre(self, i: int):
        def hook(module, args, kwargs):
            if i in self.inputs:
                return None
            where, t = first_tensor(args, kwargs)
            if t is None:
                return None
            if self.feed is not None and i in self.feed:
                t = self.feed[i]
                if isinstance(where, int):
                    args = args[:where] + (t,) + args[where + 1:]
                else:
                    kwargs = {**kwargs, where: t}
                self.inputs[i] = t
                return args, kwargs
            self.inputs[i] = t.detach()
            return None
        return hook

    def _post(self, i: int):
        def hook(module, args, out):
            if i not in self.outputs:
                t = _out_tensor(out)
                if t is not None:
                    self.outputs[i] = t
        return hook

    def clear(self) -> None:
        self.inputs.clear()
        self.outputs.clear()
        if self.feed is not None:
            self.feed.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def run_model(model: nn.Module, x: Any) -> Any:
    """``model(x)``: a tensor, positional tensors (tuple/list) or keyword tensors (dict)."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def normalised_mse(student: Tensor, teacher: Tensor) -> Tensor:
    """MSE divided by the teacher's mean square: every group's loss is O(1) whatever its scale."""
    return (student - teacher).square().mean() / teacher.square().mean().clamp(min=1e-12)


def to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    return x
