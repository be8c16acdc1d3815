"""What save_* does when asked, after the two files are written: an FP32 export of the model
you compressed (``fp32_model=``) beside them, and the one-line summary of ``openamct verify``
(deploy vs FP32 speed in ONNX Runtime, agreement, float ops left) handed to ``report=``.

Both are keyword-only with None defaults: a call without them saves exactly as upstream's.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from openamct.export.export_layer import inputs_on_cpu
from openamct.export.ids import SAVE_ID_KEY
from openamct.export.onnx_kinds import FP32_OF_KEY
from openamct.export.verify import summary_line, verify_files
from openamct.export.writer import export_onnx, write_onnx
from openamct.graph.capture import split_input_data

logger = logging.getLogger(__name__)

__all__ = ["after_save", "check_after_save", "fp32_path", "unfused_attention", "write_fp32"]


def fp32_path(fake_path: str) -> str:
    """``{save_path}_fp32_model.onnx``: the fake-quant file's name with ``fp32`` for ``fake_quant``."""
    folder, base = os.path.split(fake_path)
    return os.path.join(folder, base[: -len("fake_quant_model.onnx")] + "fp32_model.onnx")


def check_after_save(fp32_model: Any, report: Any) -> nn.Module | None:
    """The keyword arguments, checked before any work; the plain module of ``fp32_model``."""
    from openamct._checks import unwrap

    if report is not None and not callable(report):
        raise TypeError(f"report must be a callable taking one str (print, a logger's info) or None, "
                        f"got {type(report).__name__}")
    if fp32_model is None:
        return None
    model = unwrap(fp32_model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp32_model must be a torch.nn.Module or None, got {type(fp32_model).__name__}")
    if hasattr(model, "_openamct"):
        raise ValueError("fp32_model is a compressed model: pass the float model you gave create_* "
                         "(the baseline the deploy model is compared with)")
    return model


@contextlib.contextmanager
def unfused_attention():
    """nn.MultiheadAttention's fused eval path has no ONNX export; the unfused path computes
    the same function. Every export of a model runs in this context."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def write_fp32(model: nn.Module, path: str, input_data: Any, save_id: str | None, input_names=None,
               output_names=None, dynamic_axes=None) -> None:
    """Export ``model`` (an eval-mode CPU copy; ``model`` is left as it is) to ``path`` with
    the names and dynamic axes of the pair, stamped with the pair's save id."""
    work = copy.deepcopy(model).cpu().eval()
    with unfused_attention():
        proto = export_onnx(work, inputs_on_cpu(input_data), input_names, output_names, dynamic_axes,
                            work_dir=os.path.dirname(os.path.abspath(path)))
    del work
    if save_id is not None:
        entry = proto.metadata_props.add()
        entry.key, entry.value = FP32_OF_KEY, save_id
    write_onnx(proto, path)


def _feeds(input_data: Any, deploy_path: str) -> dict[str, np.ndarray] | None:
    """``input_data``'s tensors by the deploy model's input names (in order), or None when they
    do not line up one to one."""
    import onnxruntime as ort

    args, kwargs = split_input_data(inputs_on_cpu(input_data))
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    names = [i.name for i in ort.InferenceSession(deploy_path, providers=["CPUExecutionProvider"]).get_inputs()]
    if len(names) != len(tensors):
        return None
    return {n: t.detach().numpy() for n, t in zip(names, tensors, strict=True)}


def after_save(fake_path: str, deploy_path: str, input_data: Any, fp32_model: nn.Module | None,
               report: Callable[[str], Any] | None, input_names=None, output_names=None,
               dynamic_axes=None) -> str | None:
    """Write the FP32 export when ``fp32_model`` is given; when ``report`` is, compare the files
    (``verify_files`` on ``input_data`` and random inputs of its shapes; random ones of its first
    tensor's shape where its tensors are not the file's inputs one to one), log the summary line
    at INFO and pass it to ``report``. Returns the line (None without ``report``)."""
    files = [deploy_path] if fake_path == deploy_path else [deploy_path, fake_path]
    if fp32_model is not None:
        meta = {p.key: p.value for p in onnx.load(deploy_path, load_external_data=False).metadata_props}
        target = fp32_path(fake_path)
        write_fp32(fp32_model, target, input_data, meta.get(SAVE_ID_KEY), input_names, output_names, dynamic_axes)
        logger.info("wrote the FP32 export %s", target)
        files.append(target)
    if report is None:
        return None
    feeds = _feeds(input_data, deploy_path)
    if feeds is not None:
        result = verify_files(files, feeds=feeds)
    else:  # input_data's tensors do not line up with the file's inputs: random ones of the first's shape
        args, kwargs = split_input_data(input_data)
        first = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        result = verify_files(files, tuple(first.shape))
    line = summary_line(result)
    logger.info("%s", line)
    report(line)
    return line
