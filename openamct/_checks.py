"""Argument checks for the public API: each failure names the argument (upstream: check_params)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn


def check_type(name: str, value: Any, types: type | tuple[type, ...], allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, types):
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        if allow_none:
            want += " or None"
        raise TypeError(f"{name} must be {want}, got {type(value).__name__}")


def unwrap(model: Any) -> Any:
    """The module inside DistributedDataParallel / DataParallel."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


def check_model(model: Any, name: str = "model", float32_only: bool = True) -> nn.Module:
    """``model`` is a plain, finite nn.Module; ``float32_only``: every floating-point parameter
    is float32 (what create_* trains and exports)."""
    check_type(name, model, nn.Module)
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise ValueError(f"{name} is wrapped in {type(model).__name__}: call create_*/restore_* on the plain "
                         "model first, then wrap the returned model for distributed training")
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"{name} has parameters on the meta device ({meta[0]!r} ...): load real weights "
                         "(e.g. model.to_empty(device='cpu') and load_state_dict) before compressing it")
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise ValueError(f"{name} was compiled with torch.compile: pass the module before compiling "
                         f"({name}._orig_mod) and compile the model that create_*/restore_* returns")
    scripted = next((n or "(the model)" for n, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)), None)
    if scripted is not None:
        raise ValueError(f"{name}: {scripted!r} is a TorchScript module (torch.jit.script/trace); openamct needs "
                         "the Python nn.Module it was made from")
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    odd = next(((n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32),
               None) if float32_only else None
    if odd is not None:
        raise ValueError(f"{name} has {odd[1]} tensors ({odd[0]!r}): openamct trains and exports float32 models "
                         f"(see docs/limits.md); call {name}.float() first and cast the returned model if you "
                         "train in mixed precision (torch.autocast works)")
    bad = next((n for n, t in tensors if t.is_floating_point() and not all_finite(t)), None)
    if bad is not None:
        raise ValueError(f"{name}: {bad!r} holds NaN/inf values: load finite weights before compressing")
    return model


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/inf in ``t``. A finite sum proves it in one pass with no temporary (a NaN or an
    inf makes the sum NaN or inf); only a sum that overflowed or met one is checked value by
    value, a slice at a time (isfinite of a whole 1.1B model allocated a bool copy of it)."""
    if t.numel() == 0 or bool(torch.isfinite(t.detach().sum())):
        return True
    flat = t.detach().reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(1 << 20))


def check_input_data(input_data: Any) -> None:
    def ok(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return True
        if isinstance(v, (tuple, list)):
            return all(ok(x) or x is None for x in v)
        if isinstance(v, dict):
            return all(isinstance(k, str) and (ok(x) or x is None) for k, x in v.items())
        return False

    if not ok(input_data) or (isinstance(input_data, (tuple, list, dict)) and len(input_data) == 0):
        raise TypeError("input_data must be a torch.Tensor, a non-empty tuple/list of tensors, or a dict of "
                        f"keyword tensors (Hugging Face style), got {type(input_data).__name__}")

    def tensors(v: Any, path: str):
        if isinstance(v, torch.Tensor):
            yield path, v
        elif isinstance(v, (tuple, list)):
            for i, x in enumerate(v):
                yield from tensors(x, f"{path}[{i}]")
        elif isinstance(v, dict):
            for k, x in v.items():
                yield from tensors(x, f"{path}[{k!r}]")

    for where, t in tensors(input_data, "input_data"):
        if t.is_meta:
            raise ValueError(f"{where} is on the meta device: give real "
                             "sample values (calibration and graph capture run the model on them)")
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where} holds NaN/inf values: give finite sample data")


def check_dynamic_axes(dynamic_axes: Any) -> None:
    if dynamic_axes is None:
        return
    if not isinstance(dynamic_axes, dict):  # a wrong type is a TypeError, as upstream AMCT raises
        raise TypeError(f"dynamic_axes must be a dict {{name: [axes] or {{axis: 'label'}}}} or None, "
                        f"got {type(dynamic_axes).__name__}")
    for key, axes in dynamic_axes.items():
        if not isinstance(key, str):
            raise ValueError(f"dynamic_axes keys must be input/output names (str), got {key!r}")
        if isinstance(axes, (list, tuple)):
            bad = [a for a in axes if not (isinstance(a, int) and not isinstance(a, bool) and a >= 0)]
        elif isinstance(axes, dict):
            bad = [a for a, label in axes.items()
                   if not (isinstance(a, int) and not isinstance(a, bool) and a >= 0 and isinstance(label, str))]
        else:
            raise ValueError(f"dynamic_axes[{key!r}] must be a list of non-negative ints or a dict int -> str, "
                             f"got {type(axes).__name__}")
        if bad:
            raise ValueError(f"dynamic_axes[{key!r}] has invalid axes {bad!r}: use non-negative ints "
                             "(and str labels in the dict form)")


def check_names(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name} must be a list of str or None, got {value!r}")


def save_paths(save_path: str) -> tuple[str, str]:
    """(fake_quant_path, deploy_path) for AMCT's save_path prefix rules."""
    check_type("save_path", save_path, str)
    if not save_path:  # upstream's rule: the working folder, bare names
        folder, prefix = ".", ""
    elif save_path.endswith(("/", os.sep)):
        folder, prefix = save_path, ""
    else:
        folder, base = os.path.split(save_path)
        folder = folder or "."
        prefix = base + "_"
    # A folder that does not exist yet is made when the files are written (pipeline.save); a
    # path through a file is refused with the other output checks (output_paths.check_output).
    return (os.path.join(folder, f"{prefix}fake_quant_model.onnx"),
            os.path.join(folder, f"{prefix}deploy_model.onnx"))
