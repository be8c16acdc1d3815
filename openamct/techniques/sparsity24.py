"""2:4 structured sparsity as a technique: an ``NMSparsifier`` per planned layer.

Masks are computed from the weights at the first training batch (or recomputed every
``update_freq`` batches), not at create; they reach the record as soon as they exist or
change. Restore installs the record's masks; the checkpoint's own copies (buffers) then load
over them, and where the two differ the checkpoint's win (see ``after_checkpoint``). Export
needs nothing: the masks are folded into the exported weights.

Large models' masks go to a mask file beside the record (``record/sidecar.py``). The layers
hold their masks packed in the record's bit order (``sparsity/mask_bits.py``), so the mask file is
their bytes; its content is kept per set of mask versions, so a record write after a scale
change copies nothing and rewrites no mask.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from openamct.config.errors import ConfigError, locate
from openamct.config.rules import PRUNE, prune_kind
from openamct.record import attrs
from openamct.record.mask_codec import bits_of_words, num_words, pack_mask, unpack_bits, unpack_rows
from openamct.record.scale_offset_record_pb2 import PruneRecord, ScaleOffsetRecord
from openamct.record.sidecar import FILE, SIDECAR_MIN_WEIGHTS, MaskBlob, SidecarOut, SidecarReader
from openamct.techniques.base import Context, Technique, selective_algorithm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NMSpec:
    update_freq: int = 0
    data_aware: bool = False  # openamct's activation_aware_prune: |w| * ||x|| over batch_num forwards
    batch_num: int = 1
    n: int = 2
    m: int = 4


def is_mask_entry(entry: PruneRecord) -> bool:
    """An upstream-style 2:4 mask entry (other techniques tag theirs with an algorithm)."""
    return entry.HasField("selective_prune") and selective_algorithm(entry) is None


def masks_in_record(record: ScaleOffsetRecord, record_file: str | None = None,
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """2:4 masks stored in a record, by layer name, as 0/1 tensors of the weights' shapes.
    ``record_file``: the record's path, needed when its masks are in a mask file (checked
    against the record's size and hash)."""
    return {name: unpack_bits(bits, 0, math.prod(shape)).view(shape).to(dtype)
            for name, (shape, bits) in packed_masks_in_record(record, record_file).items()}


def packed_masks_in_record(record: ScaleOffsetRecord, record_file: str | None = None
                           ) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    """Layer name -> (mask shape, packed mask): what restore installs, never unpacked whole
    (a bool copy of every mask costs a byte per weight)."""
    masks = {}
    sidecars = SidecarReader(record_file)
    for pr in record.prune_record:
        if not is_mask_entry(pr):
            continue
        node = pr.selective_prune
        shape = attrs.get_ints(node, "mask_shape")
        if shape is not None and attrs.find(node, FILE) is not None:
            numel = 1
            for d in shape:
                numel *= max(int(d), 0)
            words = sidecars.words(node, num_words(numel))
        else:
            words = attrs.get_ints(node, "selective_mask")
        if shape is None or words is None:
            raise ValueError(f"record_file: selective_prune {node.name!r} lacks mask_shape or selective_mask")
        try:
            masks[node.name] = (tuple(int(d) for d in shape), bits_of_words(shape, words))
        except ValueError as exc:
            raise ValueError(f"record_file: selective_prune {node.name!r}: {exc}") from None
    return masks


def add_mask_entry(record: ScaleOffsetRecord, name: str, mask: torch.Tensor) -> PruneRecord:
    entry = record.prune_record.add()
    shape, words = pack_mask(mask)
    node = entry.selective_prune
    node.name = name
    attrs.add_ints(node, "mask_shape", shape)
    attrs.add_ints(node, "selective_mask", words)
    return entry


def check_nm_pattern(bits: torch.Tensor, shape: tuple[int, ...], axis: int, groups: int, what: str) -> None:
    """A ready 2:4 mask (packed, ``mask_bits``' layout) keeps at most 2 of every 4 weights;
    anything else (e.g. all ones) would be exported as if it were sparse. ValueError naming
    ``what``. Counted a slice of rows at a time when groups run along another axis: the whole
    mask unpacked and counted cost 3 bytes per weight (a 60M model's restore peaked on it)."""
    from openamct.sparsity.nm import row_slices

    numel = math.prod(shape)
    if not numel:
        return
    extra = kept = 0
    for rows in [slice(0, shape[0])] if axis == 0 else row_slices(shape):
        keep = unpack_rows(bits, shape, rows)
        extra += excess_over_2_of_4(keep, axis, groups)
        kept += int(keep.sum())
    if extra:
        raise ValueError(f"{what} is not a 2:4 mask: {extra} group(s) of 4 weights keep more than 2 "
                         f"({kept} of {numel} weights kept)")



def excess_over_2_of_4(keep: torch.Tensor, axis: int, groups: int) -> int:
    """Kept weights beyond 2 per group of 4 along ``axis`` (each conv group padded on its own, as
    ``compute_nm_mask`` groups them). Counting, not recomputing a mask: restore checks every mask
    twice, and recomputing took 30 of 51 s for a 60M-parameter model."""
    k = keep.movedim(axis, -1)
    k = k.unflatten(-1, (groups, k.shape[-1] // groups)).to(torch.uint8)
    pad = (-k.shape[-1]) % 4
    if pad:
        k = torch.cat([k, k.new_zeros(*k.shape[:-1], pad)], dim=-1)
    counts = k.unflatten(-1, (-1, 4)).sum(-1, dtype=torch.int16)
    return int((counts - 2).clamp_(min=0).sum())


def mask_changes(recorded: dict[str, torch.Tensor], sparsifiers: dict) -> dict[str, torch.Tensor]:
    """Layer -> a 0-dim bool tensor on the layer's device: do its mask bits differ from the
    record's? The record's bits are read on the CPU; they are moved to the mask's device (a
    CUDA model's), since comparing tensors of two devices is an error."""
    changes = {}
    for name, bits in recorded.items():
        held = sparsifiers[name].mask_bits
        if held.shape != bits.shape:
            changes[name] = torch.ones((), dtype=torch.bool, device=held.device)
        else:
            changes[name] = torch.ne(held, bits.to(held.device)).any()
    return changes


@dataclass
class SparsityState:
    masks: dict[str, tuple[tuple[int, ...], torch.Tensor] | None]  # layer -> the record's (shape, packed mask) or None
    recorded: dict[str, torch.Tensor] = field(default_factory=dict)  # restore: packed masks installed from the record
    versions: dict[str, int] = field(default_factory=dict)  # mask versions the record describes
    blob: tuple[tuple, MaskBlob] | None = None  # the last mask file's content, by (layer, version)s


def _sparsifiers(layers) -> dict:
    return {n: m.sparsity for n, m in layers.items() if getattr(m, "sparsity", None) is not None}


class Sparsity24(Technique):
    name = "2:4"
    after = ("filter_prune",)  # masks over the channels that remain
    family = PRUNE
    layer_types = ("Conv2d", "ConvTranspose2d", "Linear", "Conv1D")

    def configured_by(self, block) -> bool:
        return block.HasField("prune_config") and block.prune_config.WhichOneof("prune_algo") == "n_out_of_m_pruner"

    def validate_block(self, b, where: str, text: str, src: str) -> None:
        if prune_kind(b, where, text, src) != "n_out_of_m_pruner":
            return
        if b.prune_config.n_out_of_m_pruner.WhichOneof("n_out_of_m_algo") is None:
            raise ConfigError(f"{src}: {locate(text, 'n_out_of_m_pruner')}{where}.prune_config.n_out_of_m_pruner is empty: "
                              "give l1_selective_prune { n_out_of_m_type: M4N2 }")

    def eligible(self, info) -> str | None:
        from openamct.sparsity.nm_layers import nm_eligible

        ok, why_not = nm_eligible(info.module)
        return None if ok else f"2:4: {why_not}"

    def layer_spec(self, cfg, info, api: str, notes: list[str]) -> NMSpec | None:
        block = self.prune_block(cfg, info, notes)
        if block is None:
            return None
        nm = block.prune_config.n_out_of_m_pruner
        if nm.WhichOneof("n_out_of_m_algo") == "activation_aware_prune":
            return NMSpec(update_freq=0, data_aware=True, batch_num=max(1, int(cfg.batch_num)))
        return NMSpec(update_freq=int(nm.l1_selective_prune.update_freq))

    def owns(self, entry: PruneRecord) -> bool:
        return is_mask_entry(entry)

    def plan(self, ctx: Context) -> SparsityState:
        return SparsityState({lp.name: None for lp in self.planned(ctx.plan)})

    def from_record(self, ctx: Context) -> SparsityState:
        masks = packed_masks_in_record(ctx.record, ctx.record_file)
        return SparsityState({lp.name: masks.get(lp.name) for lp in self.planned(ctx.plan)} | {
            n: m for n, m in masks.items() if n not in ctx.plan.layers or self.name not in ctx.plan.layers[n].specs})

    def check_restore(self, ctx: Context, state: SparsityState) -> None:
        planned = {lp.name for lp in self.planned(ctx.plan)}
        for name in state.masks:
            if name not in planned:
                raise ValueError(f"record_file holds a 2:4 mask for layer {name!r}, which the config does not "
                                 "sparsify in this model (record from another model or config?)")
        from openamct.sparsity.nm_layers import nm_axis, nm_groups

        for name, packed in state.masks.items():
            if packed is None:
                continue
            shape, bits = packed
            module = ctx.model.get_submodule(name)
            if shape != tuple(module.weight.shape):
                raise ValueError(f"record_file: the 2:4 mask of layer {name!r} has shape {list(shape)} but "
                                 f"the layer's weight is {list(module.weight.shape)} (record from another model?)")
            check_nm_pattern(bits, shape, nm_axis(module), nm_groups(module),
                             f"record_file: selective_prune {name!r} (selective_mask)")

    def apply(self, ctx: Context, state: SparsityState) -> None:
        from openamct.sparsity.nm import NMSparsifier
        from openamct.sparsity.nm_aware import DataAwareNMSparsifier

        for name, packed in state.masks.items():
            spec, module = ctx.plan.layers[name].specs[self.name], ctx.model.get_submodule(name)
            if spec.data_aware and module.weight.shape and getattr(module, "groups", 1) == 1:
                sp = DataAwareNMSparsifier.from_module(module, 0, spec.batch_num)
            else:
                sp = NMSparsifier.from_module(module, spec.update_freq, spec.n, spec.m)
            if packed is not None:
                sp.set_mask_bits(packed[1])
                state.recorded[name] = packed[1]
            ctx.parts_of(name).sparsity = sp

    writes_sidecar = True

    def to_record(self, state: SparsityState, layers, record: ScaleOffsetRecord,
                  sidecar: SidecarOut | None = None) -> None:
        ready = {n: sp for n, sp in _sparsifiers(layers).items() if sp._ready}
        if sidecar is None or sum(sp.weight_shape.numel() for sp in ready.values()) < SIDECAR_MIN_WEIGHTS:
            for name, sp in ready.items():
                add_mask_entry(record, name, sp.mask)
            return
        key = tuple((n, sp.version) for n, sp in ready.items())
        if state.blob is None or state.blob[0] != key:
            # The held bits are the words' bytes: the blob reads them where they lie (sidecar.py).
            state.blob = (key, MaskBlob([(n, sp.mask_bits) for n, sp in ready.items()]))
        blob = state.blob[1]
        sidecar.add(blob)
        for name, sp in ready.items():
            node = record.prune_record.add().selective_prune
            node.name = name
            attrs.add_ints(node, "mask_shape", sp.weight_shape)
            sidecar.describe(node, name, blob)

    def record_due(self, state: SparsityState, layers) -> bool:
        return any(state.versions.get(n) != sp.version for n, sp in _sparsifiers(layers).items())

    def mark_recorded(self, state: SparsityState, layers) -> None:
        state.versions = {n: sp.version for n, sp in _sparsifiers(layers).items()}

    def after_checkpoint(self, state: SparsityState, layers) -> None:
        """Both agree unless masks changed between the checkpoint and the last record write
        (update_freq > 0): then the checkpoint's masks are kept, because they are the ones its
        weights and step counter were trained with (an exact resume), and the user is told. The
        record is not rewritten here: an evaluation script must not touch a live job's record;
        the resumed job rewrites it at its next mask change or eval forward after training."""
        sparsifiers = _sparsifiers(layers)
        for name, sp in sparsifiers.items():
            if bool(sp.mask_ready):
                check_nm_pattern(sp.mask_bits, sp.weight_shape, sp.axis, sp.groups,
                                 repr(name + ".sparsity.mask_bits"))
        changed = mask_changes(state.recorded, sparsifiers)
        differ = [n for n, flag in changed.items() if bool(flag)]  # restore only: one read per layer
        if differ:
            logger.warning("pth_file: the 2:4 masks of %d layer(s) (%s) differ from record_file's (the record was "
                           "rewritten after this checkpoint, update_freq > 0); using the checkpoint's, which belong "
                           "to its weights", len(differ), ", ".join(differ[:4]) + (" ..." if len(differ) > 4 else ""))
        state.recorded = {}  # compared once
        self.mark_recorded(state, layers)
