"""Give both ONNX files the same meaningful input and output names, whatever the forward takes
and returns.

A forward with positional tensor parameters exports as it is: inputs take the parameter names
(``x``, ``pixel_values``). Anything else (keyword inputs into ``**kwargs``, non-tensor
arguments, dict / ``ModelOutput`` / nested returns) exports through ``FlatIO``: inputs named
after the keywords passed, outputs after the output fields (``logits``, ``last_hidden_state``,
``hidden_states_0`` ...). Without this the exporter names them after the first op that reads
or writes them (``onnx::Mul_0``, ``241``), which differs between the fake-quant and the deploy
model. Non-tensor outputs (a KV cache object) are left out of the graph, with a log line.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _positional_names(model: nn.Module, args: tuple, kwargs: dict) -> list[str] | None:
    """Parameter names when the forward takes these inputs as plain tensor parameters."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) or len(args) > len(params):
        return None
    if any(not isinstance(a, torch.Tensor) for a in args) or any(
            v is not None and not isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    names = [p.name for p in params[:len(args)]]
    return names + [p.name for p in params[len(args):] if kwargs.get(p.name) is not None]


def flatten_outputs(out, prefix: str = "output") -> tuple[list[torch.Tensor], list[str], list[str]]:
    """(tensors, their names, names of left-out non-tensor fields) of a forward's result."""
    tensors, names, dropped = [], [], []

    def walk(obj, name: str) -> None:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            names.append(name)
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, str(k))
        elif isinstance(obj, (tuple, list)):
            for i, v in enumerate(obj):
                walk(v, f"{name}_{i}")
        elif obj is not None:
            dropped.append(name)

    if isinstance(out, torch.Tensor):
        walk(out, prefix)
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            walk(v, f"{prefix}_{i}")
    else:
        walk(out, prefix)
    return tensors, names, dropped


class FlatIO(nn.Module):
    """``model(*args, **kwargs)`` with the tensor inputs as positional arguments (in the order
    given: positional first, then the keywords) and the outputs as a flat tuple of tensors.

    The model's own parameters, buffers and children are registered on the wrapper under their
    own names (the model itself is held unregistered), so the exporter names initializers and
    nodes as if the model had been exported directly (``layer.weight``, ``/layer/Gemm``): the
    exported file needs no renaming pass, and so no loading back."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        super().__init__()
        # Own state under one private name: every other name is free for the model's children
        # (LlamaForCausalLM has one called ``model``).
        # Every tensor input, nested ones included (a forward taking ((a, b),)): a tensor left
        # inside the held arguments would be baked into the file as a constant.
        arg_slots = [(i, *path) for i, a in enumerate(args) for path in _tensor_paths(a)]
        kw_slots = [(k, *path) for k, v in kwargs.items() for path in _tensor_paths(v)]
        object.__setattr__(self, "_flatio", (model, list(args), dict(kwargs), arg_slots, kw_slots))
        for name, p in model._parameters.items():
            self.register_parameter(name, p)
        for name, b in model._buffers.items():
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        for name, child in model._modules.items():
            self.add_module(name, child)

    def forward(self, *flat):
        model, args, kwargs, arg_slots, kw_slots = self._flatio
        args, kwargs = list(args), dict(kwargs)
        for slot, t in zip(arg_slots, flat):
            args[slot[0]] = _put(args[slot[0]], slot[1:], t)
        for slot, t in zip(kw_slots, flat[len(arg_slots):]):
            kwargs[slot[0]] = _put(kwargs[slot[0]], slot[1:], t)
        tensors, _, _ = flatten_outputs(model(*args, **kwargs))
        return tuple(tensors)


def _tensor_paths(obj, path: tuple = ()) -> list[tuple]:
    """Where the tensors are inside one argument (tuples, lists, dicts), in order."""
    if isinstance(obj, torch.Tensor):
        return [path]
    if isinstance(obj, (tuple, list)):
        return [p for i, v in enumerate(obj) for p in _tensor_paths(v, (*path, i))]
    if isinstance(obj, Mapping):
        return [p for k, v in obj.items() for p in _tensor_paths(v, (*path, k))]
    return []


def _get(obj, path: tuple):
    for key in path:
        obj = obj[key]
    return obj


def _put(obj, path: tuple, value):
    """``obj`` with the item at ``path`` replaced, containers rebuilt (never edited in place)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, Mapping):
        new = dict(obj)
        new[head] = _put(obj[head], rest, value)
        return new
    items = list(obj)
    items[head] = _put(obj[head], rest, value)
    return type(obj)(items) if type(obj) in (tuple, list) else items


def flat_inputs(flat: FlatIO) -> tuple[tuple, list[str]]:
    """The tensors ``flat`` takes, in order, and their input names (a nested one's path joined
    with '_': ``input_0_1``, ``pixel_values``, ``past_0``)."""
    _, args, kwargs, arg_slots, kw_slots = flat._flatio
    tensors = [_get(args[s[0]], s[1:]) for s in arg_slots] + [_get(kwargs[s[0]], s[1:]) for s in kw_slots]
    names = (["_".join(["input", *map(str, s)]) for s in arg_slots]
             + ["_".join(map(str, s)) for s in kw_slots])
    return tuple(tensors), names


def forward_on_input_data(model: nn.Module, args: tuple, kwargs: dict):
    """One no-grad forward of the model being saved on ``input_data``: a failure here is the
    input's (a wrong shape or dtype), so it is named as such instead of torch's op error."""
    try:
        with torch.no_grad():
            return model(*args, **kwargs)
    except Exception as exc:  # whatever the model's ops raise for an input that does not fit
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(f"save_*: input_data does not fit the model: its forward failed "
                         f"({type(exc).__name__}: {first}); pass a batch shaped like the training data") from None


def export_signature(model: nn.Module, args: tuple, kwargs: dict):
    """(module to export, its args, its kwargs, input names, output names) for torch.onnx.export."""
    out = forward_on_input_data(model, args, kwargs)
    tensors, out_names, dropped = flatten_outputs(out)
    direct = _positional_names(model, args, kwargs)
    if direct is not None and isinstance(out, (torch.Tensor, tuple, list)) and not dropped:
        return model, args, kwargs, direct, out_names
    if dropped:
        logger.info("export: output field(s) %s are not tensors and are left out of the ONNX files", ", ".join(dropped))
    flat = FlatIO(model, args, kwargs)
    flat_args, in_names = flat_inputs(flat)
    return flat, flat_args, {}, in_names, out_names
