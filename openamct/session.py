"""The record keeper of one compressed model.

It is attached to the model that create_*/restore_* return (as forward hooks and the
``_openamct`` attribute) and writes the record file whenever what it describes changes:
the filter-prune decisions at create, a 2:4 mask as soon as it is computed or changes, and
the quantization scales at the first eval-mode forward after training and at save. Writes
are atomic and happen on rank 0 only, so every rank of a DDP job can hold a keeper.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from openamct.prune.mask_codec import pack_mask, unpack_mask
from openamct.record import attrs
from openamct.record.io import write_record
from openamct.record.scale_offset_record_pb2 import (
    PruneRecord,
    ScaleOffsetRecord,
    SingleLayerRecord,
)

logger = logging.getLogger(__name__)


def is_writer_rank() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def masks_in_record(record: ScaleOffsetRecord) -> dict[str, torch.Tensor]:
    """2:4 masks stored in a record, by layer name."""
    masks = {}
    for pr in record.prune_record:
        if not pr.HasField("selective_prune"):
            continue
        node = pr.selective_prune
        shape, words = attrs.get_ints(node, "mask_shape"), attrs.get_ints(node, "selective_mask")
        if shape is None or words is None:
            raise ValueError(f"record: selective_prune {node.name!r} lacks mask_shape or selective_mask")
        try:
            masks[node.name] = unpack_mask(shape, words)
        except ValueError as exc:
            raise ValueError(f"record: selective_prune {node.name!r}: {exc}") from None
    return masks


class RecordKeeper:
    def __init__(self, path: str, record: ScaleOffsetRecord, layers: dict[str, nn.Module]) -> None:
        self.path = path
        self.filter_records = filter_records_only(record)
        self.stored_quant = {e.key: e.value for e in record.record}
        self.layers = layers  # name -> CompressedLayer
        self._sparsity = {n: m.sparsity for n, m in layers.items() if getattr(m, "sparsity", None) is not None}
        self._trained = False
        # Masks installed from a record are already in it: only later changes need a write
        # (an evaluation script restoring from a live job's record must not rewrite it).
        self.mark_masks_recorded()

    # -- hooks -----------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        model._openamct = self
        model.register_forward_pre_hook(self.before_forward)
        model.register_forward_hook(self.after_forward)

    def before_forward(self, model: nn.Module, args) -> None:
        if model.training:
            self._trained = True

    def after_forward(self, model: nn.Module, args, output) -> None:
        eval_after_training = not model.training and self._trained
        if eval_after_training:
            self._trained = False
        if eval_after_training or self._masks_changed():
            self.flush()

    def ready_masks(self) -> dict[str, torch.Tensor]:
        """Copies (bool) of the 2:4 masks the model holds now, for the layers that have one."""
        return {n: sp.mask.detach().bool().clone() for n, sp in self._sparsity.items() if bool(sp.mask_ready)}

    def masks_differing_from(self, masks: dict[str, torch.Tensor]) -> list[str]:
        return [n for n, mask in masks.items() if not torch.equal(self._sparsity[n].mask.bool(), mask)]

    def mark_masks_recorded(self) -> None:
        """The masks in the model now are the record's: no rewrite is due for them."""
        self._mask_versions = {n: sp.version for n, sp in self._sparsity.items()}

    def _masks_changed(self) -> bool:
        return any(self._mask_versions.get(n) != sp.version for n, sp in self._sparsity.items())

    # -- content ---------------------------------------------------------------------------
    def build(self) -> ScaleOffsetRecord:
        record = ScaleOffsetRecord()
        for name, layer in self.layers.items():
            entry = self._quant_entry(layer)
            if entry is None:
                entry = self.stored_quant.get(name)
            if entry is not None:
                record.record.add(key=name).value.CopyFrom(entry)
        for pr in self.filter_records:
            record.prune_record.add().CopyFrom(pr)
        for name, sp in self._sparsity.items():
            if not bool(sp.mask_ready):
                continue
            shape, words = pack_mask(sp.mask)
            node = record.prune_record.add().selective_prune
            node.name = name
            attrs.add_ints(node, "mask_shape", shape)
            attrs.add_ints(node, "selective_mask", words)
        return record

    @staticmethod
    def _quant_entry(layer: nn.Module) -> SingleLayerRecord | None:
        aq = getattr(layer, "act_quant", None)
        if aq is None or not bool(aq.initialized):
            return None
        scale_d, offset_d = aq.scale_offset()
        with torch.no_grad():
            scale_w = [float(s) for s in layer.weight_scales().reshape(-1).tolist()]
        entry = SingleLayerRecord(scale_d=scale_d, offset_d=offset_d)
        entry.scale_w.extend(scale_w)
        entry.offset_w.extend([0] * len(scale_w))
        return entry

    def flush(self, path: str | None = None) -> None:
        """Write the record now (atomically; rank 0 only)."""
        target = path or self.path
        self.mark_masks_recorded()
        if not is_writer_rank():
            return
        write_record(target, self.build())
        logger.debug("record written: %s", target)


def filter_records_only(record: ScaleOffsetRecord) -> list[PruneRecord]:
    return [pr for pr in record.prune_record if not pr.HasField("selective_prune")]
