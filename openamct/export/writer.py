"""``export_pair``: write the fake-quant and the deploy ONNX models of a compressed model.

Exporter: the TorchScript one (``dynamo=False``, opset 17). Measured with torch 2.13 on the
folded ResNet-18 (2-core EPYC): 0.8-1.1 s per model against 4.7 s for dynamo, which also fails on the deploy
model (torch.export error); it takes ``dynamic_axes``/``input_names`` as AMCT users pass them,
keeps parameter names as initializer names (the deploy post-pass finds each layer's observer by
its weight name), and turns ``fake_quantize_*`` into plain QuantizeLinear/DequantizeLinear.
Opset 17 has LayerNormalization and per-axis Q/DQ and, per their support tables, is read by
ONNX Runtime since 1.12 and TensorRT's ONNX parser since 8.6.

Files are written atomically (temp file in the same folder, then rename), so a failed save
leaves any previous file intact and never a half-written one. Models whose tensors exceed
protobuf's 2 GB limit go out with ONNX external data (``<file>.data`` next to the model).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import onnx
import torch
from torch import nn

from openamct._atomic import atomic_path, atomic_write_bytes, clean_stale_temps, temp_prefix
from openamct.export.deploy import finish_deploy, fold_deploy
from openamct.export.export_layer import (
    compressed_layers,
    export_parts,
    inputs_on_cpu,
    working_copy,
)
from openamct.export.fake_quant import fold_fake_quant, fold_plain
from openamct.export.ids import SAVE_ID_KEY, hash_model, tensor_bytes
from openamct.export.int4_onnx import finish_int4_deploy, int4_initializers, native_int4
from openamct.export.recurrent import has_recurrent
from openamct.export.signature import export_signature
from openamct.graph.capture import split_input_data
from openamct.progress import Progress
from openamct.techniques import TECHNIQUES, Technique

logger = logging.getLogger(__name__)

__all__ = ["export_pair", "export_onnx", "write_onnx", "OPSET", "EXTERNAL_DATA_BYTES",
           "SAVE_ID_KEY"]

OPSET = 17
EXTERNAL_DATA_BYTES = 2**31 - 2**26  # protobuf's 2 GB limit, less room for the graph itself


def export_onnx(model: nn.Module, input_data: Any, input_names=None, output_names=None,
                dynamic_axes=None, work_dir: str | None = None) -> onnx.ModelProto:
    """TorchScript export to an in-memory ModelProto (external data loaded back in)."""
    with tempfile.TemporaryDirectory(prefix=temp_prefix("export"), dir=work_dir) as tmp:
        path = export_to_file(model, input_data, tmp, input_names, output_names, dynamic_axes)
        return onnx.load(path, load_external_data=True)


def export_to_file(model: nn.Module, input_data: Any, folder: str, input_names=None, output_names=None,
                   dynamic_axes=None) -> str:
    """TorchScript export into ``folder`` (``model.onnx``; above 2 GB the exporter writes one
    file per tensor beside it). Split from any load so a caller can free the model in between:
    the exporter's own copy and a loaded proto then never coexist with it."""
    args, kwargs = split_input_data(input_data)
    # Names both files share (signature.py); the exporter's own differ per file.
    target, args, kwargs, default_in, default_out = export_signature(model, args, kwargs)
    input_names = default_in if input_names is None else input_names
    output_names = default_out if output_names is None else output_names
    path = os.path.join(folder, "model.onnx")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
        warnings.filterwarnings("ignore", message=".*No names were found for specified dynamic axes.*")
        with torch.no_grad():
            torch.onnx.export(target, args, path, kwargs=kwargs or None, dynamo=False,
                              opset_version=OPSET, input_names=input_names,
                              output_names=output_names, dynamic_axes=dynamic_axes,
                              do_constant_folding=True)
    return path


def write_onnx(model: onnx.ModelProto, path: str, external_threshold: int = EXTERNAL_DATA_BYTES) -> None:
    """Write ``model`` to ``path`` atomically; external data (``<name>.data``) above the threshold."""
    if tensor_bytes(model) <= external_threshold:
        atomic_write_bytes(path, model.SerializeToString())
        return
    folder, base = os.path.split(os.path.abspath(path))
    data_name = base + ".data"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # onnx.save_model moves tensors out of the proto it is given
    with tempfile.TemporaryDirectory(prefix=temp_prefix("save"), dir=folder) as tmp:
        onnx.save_model(copy, os.path.join(tmp, base), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        for name in (data_name, base):  # data first: the model file must never point at nothing
            with atomic_path(os.path.join(folder, name)) as target:
                shutil.move(os.path.join(tmp, name), target)
    logger.info("%s: written with external data %s", path, data_name)


def _stamp(models: Sequence[onnx.ModelProto]) -> str:
    """Give every model of one save the same id: a digest of the pair's content (so a restore
    that writes the same models writes the same bytes, and a file of another save differs)."""
    import hashlib

    h = hashlib.sha256()
    for model in models:
        hash_model(h, model)
    save_id = h.hexdigest()[:32]
    for model in models:
        entry = model.metadata_props.add()
        entry.key, entry.value = SAVE_ID_KEY, save_id
    return save_id


def _placed(deploy: onnx.ModelProto, input_data: Any) -> onnx.ModelProto:
    """``placement="latency"`` on ``input_data``; where its tensors are not the file's inputs one
    to one, the INT8 file as it is (one WARNING)."""
    from openamct.export.placement import latency_placement

    args, kwargs = split_input_data(input_data)
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    inits = {t.name for t in deploy.graph.initializer}
    names = [i.name for i in deploy.graph.input if i.name not in inits]
    if len(names) != len(tensors):
        logger.warning("placement='latency' skipped: input_data holds %d tensors, the deploy file reads %d inputs",
                       len(tensors), len(names))
        return deploy
    return latency_placement(deploy, {n: t.detach().numpy() for n, t in zip(names, tensors, strict=True)})[0]


def export_pair(model: nn.Module, fake_path: str, deploy_path: str, input_data: Any,
                input_names=None, output_names=None, dynamic_axes=None, *,
                techniques: Sequence[Technique] = TECHNIQUES,
                external_threshold: int = EXTERNAL_DATA_BYTES, streamed_save: Callable | None = None,
                placement: str | None = None) -> None:
    """Write ``fake_path`` (float fake-quant model) and ``deploy_path`` (INT8 QDQ model).

    Works on deep copies in eval mode, on the CPU: the caller's model (DDP-wrapped or not, on
    any device) is left as it was. Without any quantized layer (prune-only) both files get the same plain float export.

    ``streamed_save`` is the save's branch point: on the large path (``pipeline.takes_large_path``)
    the pipeline passes ``openamct.large.streamed_save.export_pair_streamed`` for a model whose
    tensors are all on the CPU (``openamct.large.attach.streamed_save``), which writes each
    folded weight while it is computed, one at a time; None (any other model) folds both models
    whole here.

    ``placement="latency"``: the deploy file keeps float the blocks whose INT8 form ran slower
    here (``export/placement.py``); None writes the INT8 deploy file as it is.
    """
    folder = os.path.dirname(os.path.abspath(fake_path))
    names = {"input_names": input_names, "output_names": output_names, "dynamic_axes": dynamic_axes,
             "work_dir": folder}
    clean_stale_temps(folder)
    if os.path.dirname(os.path.abspath(deploy_path)) != folder:
        clean_stale_temps(os.path.dirname(os.path.abspath(deploy_path)))
    runtime = getattr(getattr(model, "_openamct", None), "large", None)
    if runtime is not None:  # the training step's buffers: the next step maps them again
        runtime.release()
    # Exported from a CPU copy: a CUDA model's save leaves it on its device, as it was.
    probe = working_copy(model, cpu=True)
    input_data = inputs_on_cpu(input_data)
    quantized = has_recurrent(probe) or any(export_parts(layer, techniques).quantized
                                            for layer in compressed_layers(probe).values())
    if not quantized:
        proto = export_onnx(fold_plain(probe, techniques), input_data, **names)
        del probe
        _stamp([proto])
        if tensor_bytes(proto) <= external_threshold:
            data = proto.SerializeToString()
            atomic_write_bytes(fake_path, data)
            atomic_write_bytes(deploy_path, data)
        else:
            write_onnx(proto, fake_path, external_threshold)
            write_onnx(proto, deploy_path, external_threshold)
        logger.info("no quantized layer: wrote the same float model to %s and %s", fake_path, deploy_path)
        return
    if streamed_save is not None:  # branch point: see the docstring
        streamed_save(model, probe, fake_path, deploy_path, input_data, names, techniques, external_threshold)
    else:  # both models folded whole, exported, stamped and written
        with Progress("save", total=3, logger=logger) as progress:
            int4 = int4_initializers(probe)  # INT4 weights go out as 4-bit values (int4_onnx.py)
            fake = export_onnx(fold_fake_quant(probe, techniques), input_data, **names)
            native_int4(fake, int4, reproduce=True)
            del probe
            progress.update(what="fake-quant model exported")
            work = working_copy(model, cpu=True)
            observers = fold_deploy(work, techniques)
            deploy = finish_deploy(export_onnx(work, input_data, **names), observers)
            finish_int4_deploy(deploy, int4)
            del work
            if placement == "latency":
                deploy = _placed(deploy, input_data)
            progress.update(what="deploy model exported")
            _stamp([fake, deploy])
            write_onnx(fake, fake_path, external_threshold)
            write_onnx(deploy, deploy_path, external_threshold)
            progress.update(what="written")
    logger.info("wrote %s and %s", fake_path, deploy_path)

