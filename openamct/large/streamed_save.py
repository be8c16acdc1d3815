"""The save of a CPU model with its weights streamed (``export.writer.export_pair``'s branch
point for a model on the CPU).

Both models are built before either file is moved into place: a failure leaves the old pair.
Each is staged on disk as soon as it is exported, its weights computed one layer at a time while
they are written (``deferred.py``, ``staging.py``), so no folded weight is held beyond one.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import onnx
from torch import nn

from openamct._atomic import temp_prefix
from openamct.export.deploy import finish_deploy, fold_deploy
from openamct.export.export_layer import working_copy
from openamct.export.fake_quant import fold_fake_quant
from openamct.large.deferred import (
    DeferredWeight,
    ZeroPages,
    bind_placeholders,
    defer_tables,
    deferred_weights,
)
from openamct.large.memory import return_free_memory
from openamct.large.staging import Staged, stage_streamed

logger = logging.getLogger(__name__)

__all__ = ["export_pair_streamed"]


def export_pair_streamed(model: nn.Module, probe: nn.Module, fake_path: str, deploy_path: str, input_data: Any,
                         names: dict, techniques: Sequence, external_threshold: int) -> None:
    """Write both files of ``model`` (``probe``: its working copy, folded here and dropped)."""
    folder = names["work_dir"]
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix=temp_prefix("save"), dir=folder) as stage:
        io = {k: v for k, v in names.items() if k != "work_dir"}
        fake = fold_fake_quant(probe, techniques, defer=DeferredWeight)
        defer_tables(fake)
        del probe
        staged = [_export_streamed(fake, input_data, fake_path, stage, "fake", io, external_threshold, h)]
        del fake
        gc.collect()  # the working copy's module tree has cycles: free it before the next one
        work = working_copy(model)
        observers = fold_deploy(work, techniques, defer=DeferredWeight)
        defer_tables(work)
        logger.debug("deploy model folded")
        staged.append(_export_streamed(work, input_data, deploy_path, stage, "deploy", io, external_threshold, h,
                                       lambda proto: finish_deploy(proto, observers)))
        del work
        gc.collect()
        save_id = h.hexdigest()[:32]
        for item in staged:
            item.finish(save_id)


def _export_streamed(model: nn.Module, input_data: Any, path: str, stage: str, kind: str, io: dict,
                     external_threshold: int, h, post=None) -> Staged:
    """Export a folded model with placeholder weights, run ``post`` on the (small) proto, and
    stage it with its weights written one at a time."""
    folder = os.path.join(stage, kind)  # the exporter's own folder; the two files may share a name
    os.mkdir(folder)
    from openamct.export.writer import export_to_file

    zeros = ZeroPages()  # the placeholders' zeros: needed by the probe and the trace only
    for d in deferred_weights(model)[0].values():
        d.zeros = zeros
    try:
        file = export_to_file(model, input_data, folder, **io)
    finally:
        zeros.release()
    held, order = deferred_weights(model)  # by the names the trace gave them (``weight_t``)
    for d in held.values():
        d.zeros = None
    proto = onnx.load(file, load_external_data=True)
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    logger.debug("%s model exported", kind)
    return_free_memory()  # what the trace freed: the post-pass and the writer come on top
    deferred = bind_placeholders(proto, held)
    if post is not None:
        proto = post(proto)
    staged = stage_streamed(proto, deferred, order, path, folder, external_threshold, h)
    del proto
    return_free_memory()  # the per-layer temporaries' freed heap, before the next model
    logger.debug("%s model staged", kind)
    return staged
