"""Export problems found before the export runs, each as one line naming the
argument, or the module and the op, instead of a TorchScript IR dump after training.

- ``check_modules``: modules the ONNX (TorchScript, opset 17) exporter cannot write, found by
  a cheap scan at create and again before save.
- ``check_names``: ``input_names`` / ``output_names`` / ``dynamic_axes`` against the model's
  real inputs and outputs (one eval forward of a copy).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

# class -> (ONNX export failure, what to do). Certain failures are refused; others warned.
_UNEXPORTABLE = {
    nn.ChannelShuffle: ("aten::channel_shuffle has no ONNX export at opset 17",
                        "write the shuffle as x.view(n, g, c // g, h, w).transpose(1, 2).reshape(n, c, h, w)"),
}


def check_modules(model: nn.Module, when: str) -> None:
    for name, m in model.named_modules():
        for cls, (why, fix) in _UNEXPORTABLE.items():
            if isinstance(m, cls):
                raise ValueError(f"model: module {name!r} ({cls.__name__}) cannot be exported to ONNX ({why}): {fix}")


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flat(o)]
    return []


def check_names(model: nn.Module, input_data: Any, input_names, output_names, dynamic_axes) -> None:
    """Refuse names the exporter would silently ignore or misapply."""
    from openamct.graph.capture import split_input_data

    args, kwargs = split_input_data(input_data)
    inputs = _flat(list(args)) + _flat([v for v in kwargs.values() if v is not None])
    for arg, names in (("input_names", input_names), ("output_names", output_names)):
        if names is not None and len(set(names)) != len(names):
            dup = next(n for n in names if list(names).count(n) > 1)
            raise ValueError(f"{arg} names {dup!r} twice: each ONNX input/output needs its own name")
    if input_names is not None and len(input_names) > len(inputs):
        raise ValueError(f"input_names has {len(input_names)} names but the model takes {len(inputs)} input "
                         f"tensor(s): {list(input_names)[len(inputs):]} name nothing")
    if output_names is None and not dynamic_axes:
        return
    from openamct.export.export_layer import working_copy
    from openamct.export.signature import export_signature, flatten_outputs, forward_on_input_data

    work = working_copy(model)
    outputs = flatten_outputs(forward_on_input_data(work, args, kwargs))[0]
    if output_names is not None and len(output_names) > len(outputs):
        raise ValueError(f"output_names has {len(output_names)} names but the model returns {len(outputs)} "
                         f"tensor(s): {list(output_names)[len(outputs):]} name nothing")
    _, _, _, default_in, default_out = export_signature(work, args, kwargs)  # the names export will use
    in_names = list(input_names) if input_names is not None else (default_in or [])
    out_names = list(output_names) if output_names is not None else default_out
    ranks = {n: t.dim() for n, t in zip(in_names, inputs)} | {n: t.dim() for n, t in zip(out_names, outputs)}
    for key, axes in (dynamic_axes or {}).items():
        if key not in ranks:
            raise ValueError(f"dynamic_axes names {key!r}, which is no input or output of the export (inputs "
                             f"{in_names}, outputs {out_names}): a misspelled name would give a fixed-shape model")
        for axis in (axes.keys() if isinstance(axes, dict) else axes):
            if axis >= ranks[key]:
                raise ValueError(f"dynamic_axes[{key!r}] has axis {axis}, but {key!r} has only {ranks[key]} "
                                 f"dimension(s) (axes 0..{ranks[key] - 1})")


_OP_MODULES = {"aten::_native_multi_head_attention": nn.MultiheadAttention, "aten::channel_shuffle": nn.ChannelShuffle}


def explain_export_error(model: nn.Module, exc: Exception) -> ValueError:
    """One line naming the op and the module(s) behind it, instead of the exporter's IR dump."""
    import re

    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    m = re.search(r"'(aten::\w+|prim::\w+|onnx::\w+)'", first)
    op = m.group(1) if m else None
    cls = _OP_MODULES.get(op)
    names = [n for n, mod in model.named_modules() if cls is not None and isinstance(mod, cls)]
    where = f" in module {names[0]!r} ({cls.__name__})" if names else ""
    return ValueError(f"save_*: ONNX export failed{where}: {first}")
