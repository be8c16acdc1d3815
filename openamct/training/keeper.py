"""The record keeper of one compressed model.

It is attached to the model that create_*/restore_* return (as forward hooks and the
``_openamct`` attribute) and writes the record file whenever what it describes changes: at
create, as soon as a technique says its entries are out of date (a 2:4 mask computed or
changed), at the first eval-mode forward after training (the quantization scales) and at
save. Each technique writes its own entries. Writes are atomic and happen on rank 0 only, so
every rank of a DDP job can hold a keeper.

A write that a training forward triggers (the first batch's 2:4 masks) is not done inside the
step: the record is built from the model there (cheap: the layers hold their masks packed in
the record's bit order, and the mask file's content is kept per set of mask versions), and serialised and written by one background thread while backward and the optimizer
run. At most one such write is in flight; ``wait()`` joins it, and everything that
reads or replaces the record joins it first: the next write, an eval-mode write, ``flush``
(create, save), ``state_dict`` (a checkpoint must not be newer than the record it goes with
unnoticed) and interpreter exit (the thread is not a daemon).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
from torch import nn

from openamct.quant.activation import QuantizedActivation
from openamct.quant.quantizers import ActULQ
from openamct.record.file_io import write_record
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.record.sidecar import SidecarOut, remove_unnamed_sidecars, write_sidecars
from openamct.training.guard import locate, outputs_finite

logger = logging.getLogger(__name__)


def is_writer_rank() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class RecordKeeper:
    def __init__(self, path: str, applied: list[tuple[Any, Any]], layers: dict[str, nn.Module]) -> None:
        self.path = path
        self.decisions: list[tuple[str, int]] = []  # (layer, digest) the model carries (training/decisions.py)
        self.applied = applied  # (technique, its state), in the order they were applied
        self.layers = layers  # name -> CompressedLayer
        self._trained = False
        self._writer: threading.Thread | None = None  # the background write in flight
        self._write_error: OSError | None = None
        self._retry = False  # a background write failed: write again at the next forward
        # (path, record, header, (size, mtime) of the file) of the last write: an unchanged
        # record is not written again (save after an eval forward rewrote megabytes of scales).
        self._last: tuple | None = None
        self.header = ""  # comment lines written above the record: the model's fingerprint
        self.large_model = False  # whether build took the large-model path (pipeline.takes_large_path)
        self.large = None  # the model's LargeRuntime (large/runtime.py) when build gave it one
        self.record_text = None  # the record's fast printer (record.file_io.FastText) when build gave one
        self.training_forwards = 0  # counted for the bad-value guard's message
        self._locating = False  # the guard is running a batch again: the hooks stand aside
        # Found at the first forward (a model's modules do not change after build): what a
        # forward may change (rollback.stateful_modules), the quantization-parameter tables of
        # its activation quantizers, one per format, and the steady copy's buffers.
        self._stateful: list | None = None
        self._tables: list = []
        self._steady = None
        # What was installed from a record is already in it: only later changes need a write
        # (an evaluation script restoring from a live job's record must not rewrite it).
        self.mark_recorded()

    def __getstate__(self) -> dict:
        # Copies (the export's working copy) share no write in flight: a thread cannot be copied.
        return {**self.__dict__, "_writer": None, "_write_error": None, "_last": None, "_stateful": None,
                "_tables": [], "_steady": None}

    @property
    def techniques(self) -> list:
        return [t for t, _ in self.applied]

    # -- hooks -----------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        model._openamct = self
        model.register_forward_pre_hook(self.before_forward, with_kwargs=True)
        model.register_forward_hook(self.after_forward, with_kwargs=True)
        model.register_state_dict_pre_hook(lambda *_: (self.undo_failed_forward(), self.wait()))
        # A mask file in writing reads the live masks (sidecar.MaskBlob): a load must wait for it.
        model._register_load_state_dict_pre_hook(lambda *_: self.wait())

    def undo_failed_forward(self) -> None:
        """Put back the state a forward that raised had changed (see training/rollback.py)."""
        snap, self._snapshot = getattr(self, "_snapshot", None), None
        if snap is not None:
            if snap.masks_due:
                self.wait()  # the masks put back may be ones a mask file in writing reads
            snap.restore()
            logger.debug("state of a forward that raised put back")

    # The keeper's hooks are host bookkeeping (snapshots, counters, the bad-value guard's read):
    # a compiled model runs them eagerly, one break before and one after its forward.
    def _modules_of(self, model: nn.Module) -> list:
        """``rollback.stateful_modules`` of ``model``, found once; the activation quantizers
        among them take their quantization parameters from one table per format."""
        if self._stateful is None:
            from openamct.quant.act_qparams import QParamTable
            from openamct.training.rollback import SteadyCopy, stateful_modules

            self._stateful = stateful_modules(model, self.layers)
            by_format: dict = {}
            for m, _ in self._stateful:
                if isinstance(m, ActULQ):
                    by_format.setdefault(m.format, []).append(m)
            self._tables = [QParamTable(qs, fmt) for fmt, qs in by_format.items()]
            for table in self._tables:
                for q in table.quantizers:
                    q.use_table(table)
            self._steady = SteadyCopy()
        return self._stateful

    @torch.compiler.disable
    def before_forward(self, model: nn.Module, args, kwargs) -> None:
        from openamct.training.rollback import ForwardSnapshot

        if self._locating:
            return
        self.undo_failed_forward()
        modules = self._modules_of(model)
        for table in self._tables:  # once per forward for all quantizers (a no-op while clips stand)
            table.refresh()
        self._snapshot = ForwardSnapshot(modules, model.training, self._steady)
        if self._snapshot.masks_due:
            self.wait()  # a mask file in writing reads the masks this forward may recompute
        if model.training:
            self._trained = True
            self.training_forwards += 1

    @torch.compiler.disable
    def after_forward(self, model: nn.Module, args, kwargs, output) -> None:
        if self._locating:
            return
        if model.training and not outputs_finite(output):
            self._refuse_bad_values(model, args, kwargs)
        self._snapshot = None
        eval_after_training = not model.training and self._trained
        if eval_after_training:
            self._trained = False
        if self._writer is not None and not self._writer.is_alive():
            self.wait()  # finished: learn now whether it failed (never blocks)
        retry, self._retry = self._retry, False
        if not (retry or eval_after_training or any(t.record_due(s, self.layers) for t, s in self.applied)):
            return
        if model.training:
            self.write_in_background()
            return
        try:
            self.flush()
        except OSError as exc:
            # Never crash the user's forward over the record: it stays due and is written at
            # the next forward that can (or save, which reports it).
            self._trained = self._trained or eval_after_training
            self._write_failed_now(exc)
        else:
            self._write_failed = False

    def _refuse_bad_values(self, model: nn.Module, args, kwargs) -> None:
        """A NaN/inf came out of a training forward: put the model back as it was before it,
        find where the value entered, and stop the step before its backward."""
        self.undo_failed_forward()
        watched = {n: m for n, m in model.named_modules()
                   if n in self.layers or isinstance(m, QuantizedActivation)}
        self._locating = True
        try:
            from openamct.training.rollback import ForwardSnapshot

            snap = ForwardSnapshot(self._modules_of(model), model.training)
            where = locate(model, watched, args, kwargs)
            snap.restore()
        finally:
            self._locating = False
        raise ValueError(f"training step {self.training_forwards}: a NaN/inf value reached {where}. The model is as "
                         "it was before this forward (no clip, statistic or mask took the value); check the batch, "
                         "or lower the learning rate if the parameters diverged")

    def _write_failed_now(self, exc: OSError) -> None:
        if not getattr(self, "_write_failed", False):
            logger.error("record_file %r cannot be written (%s); the model keeps training and the record "
                         "is written as soon as it can be", self.path, exc)
        self._write_failed = True
        self._retry = True

    # -- writing ---------------------------------------------------------------------------
    def write_in_background(self) -> None:
        """Build the record now, write it on a thread (joined by the next write or ``wait``)."""
        self.wait()
        if not is_writer_rank():
            self.mark_recorded()
            return
        target = self.path
        sidecar = SidecarOut(target)
        record = self.build(sidecar)
        self.mark_recorded()  # what was built is what the record will say; a failure sets _retry

        def run() -> None:
            try:
                self._write_if_changed(target, record, sidecar)
            except OSError as exc:
                self._write_error = exc

        self._writer = threading.Thread(target=run, name="openamct-record", daemon=False)
        self._writer.start()

    def wait(self) -> None:
        """Join the background write in flight, if any (a failure is logged once, then retried)."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        writer.join()
        exc, self._write_error = self._write_error, None
        if exc is not None:
            self._write_failed_now(exc)
        else:
            self._write_failed = False

    def mark_recorded(self) -> None:
        for technique, state in self.applied:
            technique.mark_recorded(state, self.layers)

    def after_checkpoint(self) -> None:
        for technique, state in self.applied:
            technique.after_checkpoint(state, self.layers)

    # -- content ---------------------------------------------------------------------------
    def build(self, sidecar: SidecarOut | None = None) -> ScaleOffsetRecord:
        record = ScaleOffsetRecord()
        for technique, state in self.applied:
            # Masks go to a mask file only on the large path: other records keep upstream's format.
            if sidecar is not None and technique.writes_sidecar and self.large_model:
                technique.to_record(state, self.layers, record, sidecar=sidecar)
            else:
                technique.to_record(state, self.layers, record)
        return record

    def flush(self, path: str | None = None) -> None:
        """Write the record now (atomically; rank 0 only), its mask file first (sidecar.py)."""
        target = path or self.path
        self.wait()
        if is_writer_rank():
            sidecar = SidecarOut(target)
            self._write_if_changed(target, self.build(sidecar), sidecar)
        self.mark_recorded()  # after the write: a failed one leaves the record due

    def _write_if_changed(self, target: str, record: ScaleOffsetRecord, sidecar: SidecarOut) -> None:
        sidecar.finish()  # the mask file's hash, here: off the training step when in background
        full = os.path.abspath(target)
        last = self._last
        if last is not None and last[:3] == (full, record, self.header) and _stat(full) == last[3]:
            write_sidecars(target, sidecar.blobs)  # nothing to do unless one was deleted
            logger.debug("record %s unchanged: not rewritten", target)
            return
        _write(target, record, self.header, sidecar, self.record_text)
        self._last = (full, record, self.header, _stat(full))
        logger.debug("record written: %s", target)


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _write(target: str, record: ScaleOffsetRecord, header: str, sidecar: SidecarOut, fast=None) -> None:
    """Mask file first, then the record, then older mask files: a crash between any two leaves
    a record whose mask file exists (sidecar.py)."""
    write_sidecars(target, sidecar.blobs)
    write_record(target, record, header, fast)
    remove_unnamed_sidecars(target, record)
