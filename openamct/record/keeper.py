"""The record keeper of one compressed model.

It is attached to the model that create_*/restore_* return (as forward hooks and the
``_openamct`` attribute) and writes the record file whenever what it describes changes: at
create, as soon as a technique says its entries are out of date (a 2:4 mask computed or
changed), at the first eval-mode forward after training (the quantization scales) and at
save. Each technique writes its own entries. Writes are atomic and happen on rank 0 only, so
every rank of a DDP job can hold a keeper.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from openamct.record.file_io import write_record
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord

logger = logging.getLogger(__name__)


def is_writer_rank() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class RecordKeeper:
    def __init__(self, path: str, applied: list[tuple[Any, Any]], layers: dict[str, nn.Module]) -> None:
        self.path = path
        self.applied = applied  # (technique, its state), in the order they were applied
        self.layers = layers  # name -> CompressedLayer
        self._trained = False
        self.header = ""  # comment lines written above the record: the model's fingerprint
        # What was installed from a record is already in it: only later changes need a write
        # (an evaluation script restoring from a live job's record must not rewrite it).
        self.mark_recorded()

    @property
    def techniques(self) -> list:
        return [t for t, _ in self.applied]

    # -- hooks -----------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        model._openamct = self
        model.register_forward_pre_hook(self.before_forward)
        model.register_forward_hook(self.after_forward)
        model.register_state_dict_pre_hook(lambda *_: self.undo_failed_forward())

    def undo_failed_forward(self) -> None:
        """Put back the state a forward that raised had changed (see compressed/rollback.py)."""
        snap, self._snapshot = getattr(self, "_snapshot", None), None
        if snap is not None:
            snap.restore()
            logger.debug("state of a forward that raised put back")

    def before_forward(self, model: nn.Module, args) -> None:
        from openamct.compressed.rollback import ForwardSnapshot

        self.undo_failed_forward()
        self._snapshot = ForwardSnapshot(self.layers, model.training)
        if model.training:
            self._trained = True

    def after_forward(self, model: nn.Module, args, output) -> None:
        self._snapshot = None
        eval_after_training = not model.training and self._trained
        if eval_after_training:
            self._trained = False
        if eval_after_training or any(t.record_due(s, self.layers) for t, s in self.applied):
            try:
                self.flush()
            except OSError as exc:
                # Never crash the user's forward over the record: it stays due and is written at
                # the next forward that can (or save, which reports it).
                self._trained = self._trained or eval_after_training
                if not getattr(self, "_write_failed", False):
                    logger.error("record_file %r cannot be written (%s); the model keeps training and the record "
                                 "is written as soon as it can be", self.path, exc)
                self._write_failed = True
            else:
                self._write_failed = False

    def mark_recorded(self) -> None:
        for technique, state in self.applied:
            technique.mark_recorded(state, self.layers)

    def after_checkpoint(self) -> None:
        for technique, state in self.applied:
            technique.after_checkpoint(state, self.layers)

    # -- content ---------------------------------------------------------------------------
    def build(self) -> ScaleOffsetRecord:
        record = ScaleOffsetRecord()
        for technique, state in self.applied:
            technique.to_record(state, self.layers, record)
        return record

    def flush(self, path: str | None = None) -> None:
        """Write the record now (atomically; rank 0 only)."""
        target = path or self.path
        if is_writer_rank():
            write_record(target, self.build(), self.header)
        self.mark_recorded()  # after the write: a failed one leaves the record due
        logger.debug("record written: %s", target)
