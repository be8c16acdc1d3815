"""Filter-prune groups <-> PruneRecord messages (upstream AMCT's record shape), and replay.

One PruneRecord per group that removes something. Producers carry ``type``, ``begin``=0,
``end``=C, ``prune_axis``, ``group`` (conv groups, when not 1), ``prune_group`` and
``prune_index`` (the removed output channels); consumers (passive layers, function nodes
and the layers reading the channels) carry ``type``, ``begin``/``end`` (the slice of their
channel axis this group occupies), ``group`` when not 1 and ``prune_index`` (the removed
positions, absolute, inside begin..end). Per-channel parameter owners are consumers too, typed
``LayerNormalization``/``RMSNormalization``/``GroupNormalization`` (those classes),
``ChannelParams`` (any other module whose tensors are per-channel vectors: GRN, LayerScale
modules) or ``Parameter`` (a bare parameter, named by its full path, e.g. ConvNeXt's
``layer_scale_parameter``). A per-head bias table (T5's ``relative_attention_bias`` Embedding) is a
consumer typed ``Gather``, its columns (one per head) the positions.
"""

from __future__ import annotations

import logging

from torch import nn

from openamct.layer_types import (
    BATCHNORM_TYPES,
    CONVS,
    TRANSPOSED_CONVS,
    features,
    is_depthwise,
    layer_type_of,
)
from openamct.record.attrs import add_int, add_ints, add_str, get_int, get_ints, get_str
from openamct.record.scale_offset_record_pb2 import PruneNode, PruneRecord, ScaleOffsetRecord
from openamct.sparsity.channel_params import (
    ATTRIBUTE,
    GROUP_NORM,
    LAYER_NORM,
    OWNER_TYPES,
    PARAMETER,
    RMS_NORM,
    owner_size,
)
from openamct.sparsity.filter import validate_removal
from openamct.sparsity.group import FUNCTION_OP_TYPES, Member, PruneGroup
from openamct.sparsity.head_bias import EMBEDDING

logger = logging.getLogger(__name__)

_OWNER_CLASSES = {EMBEDDING: nn.Embedding, LAYER_NORM: nn.LayerNorm, GROUP_NORM: nn.GroupNorm, RMS_NORM: getattr(nn, "RMSNorm", nn.LayerNorm)}
_TYPES = {"Conv": CONVS, "ConvTranspose": TRANSPOSED_CONVS, "Gemm": (nn.Linear,), "BatchNormalization": BATCHNORM_TYPES}


def _write_member(node: PruneNode, m: Member) -> None:
    add_str(node, "type", m.op_type)
    add_int(node, "begin", m.begin)
    add_int(node, "end", m.end)
    if m.group != 1:
        add_int(node, "group", m.group)


def groups_to_records(groups: list[PruneGroup], record: ScaleOffsetRecord) -> None:
    """Append one PruneRecord per group that removes channels."""
    for g in groups:
        if not g.removed:
            continue
        pr = record.prune_record.add()
        for m in g.producers:
            node = pr.producer.add(name=m.name)
            _write_member(node, m)
            add_int(node, "prune_axis", -1 if m.op_type == "Gemm" else 1)
            add_int(node, "prune_group", g.prune_group)
            if m.repeat != 1:  # whole attention heads (or GQA groups) of this many rows
                add_int(node, "prune_unit", m.repeat)
            add_ints(node, "prune_index", m.positions(g.removed))
        for m in [*g.passive, *g.consumers]:
            node = pr.consumer.add(name=m.name)
            _write_member(node, m)
            add_ints(node, "prune_index", m.positions(g.removed))


# -- replay ------------------------------------------------------------------------------------

def _op_type(m: nn.Module) -> str | None:
    row = layer_type_of(m)
    return None if row is None else row.op_type


def _axis_size(m: nn.Module, role: str) -> int:
    """Size of the axis a record node addresses: outputs for producers and passive layers,
    inputs for consumers."""
    if isinstance(m, BATCHNORM_TYPES):
        return m.num_features
    row = layer_type_of(m)
    if row is not None and row.matrix:
        return features(m)[1] if role == "producer" else features(m)[0]
    return m.out_channels if role != "consumer" else m.in_channels


class _Reader:
    def __init__(self, modules: dict[str, nn.Module], params: dict[str, nn.Parameter], idx: int,
                 pr: PruneRecord) -> None:
        self.modules, self.params = modules, params
        self.where, self.pr = f"record_file prune_record[{idx}]", pr

    def fail(self, what: str, node: PruneNode, detail: str) -> ValueError:
        return ValueError(f"{self.where}: {what} {node.name!r} {detail} (record from another model?)")

    def module(self, node: PruneNode, what: str) -> tuple[nn.Module, str]:
        kind = get_str(node, "type")
        m = self.modules.get(node.name)
        if m is None:
            raise self.fail(what, node, "does not exist in the model")
        if kind not in _TYPES or not (isinstance(m, _TYPES[kind]) or _op_type(m) == kind):
            raise self.fail(what, node, f"is a {type(m).__name__} in the model, the record says type {kind!r}")
        group = get_int(node, "group")
        if group is not None and group != getattr(m, "groups", 1):
            raise self.fail(what, node, f"has groups={getattr(m, 'groups', 1)}, the record says group={group}")
        return m, kind

    def span(self, node: PruneNode, m: nn.Module, role: str, what: str) -> tuple[int, int]:
        begin, end, size = get_int(node, "begin", 0), get_int(node, "end"), _axis_size(m, role)
        if end is None:
            raise ValueError(f"{self.where}: {what} {node.name!r} has no 'end' attribute")
        # a producer named once covers all its rows; a fused layer's pieces (several nodes of one
        # name) are slices, their tiling checked once every record is read
        whole = role == "producer" and sum(p.name == node.name for p in self.pr.producer) == 1
        if whole and (begin, end) != (0, size):
            raise self.fail(what, node, f"has {size} output channels, the record says begin={begin} end={end}")
        if not 0 <= begin < end <= size:
            raise self.fail(what, node, f"has {size} channels on the pruned axis, the record says "
                                        f"begin={begin} end={end}")
        return begin, end

    def producers(self) -> tuple[list[Member], int, list[int], int]:
        members, removed, prune_group, channels = [], None, 1, 0
        for node in self.pr.producer:
            m, kind = self.module(node, "producer")
            if kind not in ("Conv", "Gemm") or is_depthwise(m):
                raise self.fail("producer", node, "cannot be a filter-prune producer")
            axis = get_int(node, "prune_axis")
            if axis is not None and axis not in ((-1, 1) if kind == "Gemm" else (1,)):
                raise self.fail("producer", node, f"is pruned on axis {1 if kind == 'Conv' else -1}, "
                                                  f"the record says prune_axis={axis}")
            begin, end = self.span(node, m, "producer", "producer")  # a slice: one piece of a fused layer
            unit = get_int(node, "prune_unit", 1) or 1
            if unit < 1 or (end - begin) % unit:
                raise self.fail("producer", node, f"has {end - begin} output channels, not whole units of "
                                                  f"prune_unit={unit}")
            if members and (end - begin) // unit != channels:
                raise self.fail("producer", node, f"has {(end - begin) // unit} units of {unit} channels, producer "
                                                  f"{members[0].name!r} has {channels}")
            channels = (end - begin) // unit
            rows = sorted(get_ints(node, "prune_index") or [])
            idx = sorted({(r - begin) // unit for r in rows}) if unit > 1 else [r - begin for r in rows]
            member = Member(node.name, kind, begin, end, unit, getattr(m, "groups", 1), "producer")
            if unit > 1 and (member.positions(idx) != rows or any(not 0 <= c < channels for c in idx)):
                raise self.fail("producer", node, f"prune_index does not remove whole units of prune_unit={unit} "
                                                  f"inside begin={begin} end={end}")
            if removed is not None and idx != removed:
                raise self.fail("producer", node, "removes other channels than the first producer")
            removed = idx
            prune_group = max(prune_group, get_int(node, "prune_group", 1) or 1)
            members.append(member)
        if len(set(removed)) != len(removed) or any(not 0 <= c < channels for c in removed):
            raise ValueError(f"{self.where}: prune_index of {members[0].name!r} must be distinct channels "
                             f"in 0..{channels - 1}")
        if len(removed) >= channels:
            raise ValueError(f"{self.where}: prune_index of {members[0].name!r} removes all its {channels} channels")
        blk = channels // prune_group
        if channels % prune_group or len({sum(1 for c in removed if c // blk == b) for b in range(prune_group)}) > 1:
            raise ValueError(f"{self.where}: prune_group={prune_group} of {members[0].name!r} needs an equal "
                             f"removal from each of {prune_group} blocks of its {channels} channels")
        return members, channels, removed, prune_group

    def owner(self, node: PruneNode, kind: str, channels: int, removed: list[int]) -> Member:
        """A per-channel parameter owner (norm, GRN, LayerScale): its size is read off the
        module (or parameter) itself, so a record from another model is refused here."""
        if kind == ATTRIBUTE:
            owner, _, attr = node.name.rpartition(".")
            target = getattr(self.modules.get(owner), attr, None)
            target = target if type(target) is int else None
        else:
            target = self.params.get(node.name) if kind == PARAMETER else self.modules.get(node.name)
        if target is None:
            raise self.fail("consumer", node, f"does not exist in the model (type {kind!r})")
        size = (target if kind == ATTRIBUTE else getattr(target, "embedding_dim", None) if kind == EMBEDDING
                else owner_size(target))
        if size is None or kind not in (PARAMETER, ATTRIBUTE) and not isinstance(target, _OWNER_CLASSES.get(kind,
                                                                                                          nn.Module)):
            raise self.fail("consumer", node, f"is a {type(target).__name__} in the model, not a per-channel "
                                              f"parameter owner of type {kind!r}")
        begin, end = get_int(node, "begin", 0), get_int(node, "end")
        if end is None or not 0 <= begin < end <= size or (end - begin) % channels:
            raise self.fail("consumer", node, f"has {size} channels, the record says begin={begin} end={end} "
                                              f"for a group of {channels}")
        member = Member(node.name, kind, begin, end, (end - begin) // channels, 1, "passive")
        idx = get_ints(node, "prune_index")
        if idx is not None and sorted(idx) != member.positions(removed):
            raise self.fail("consumer", node, "lists other removed positions than its producers imply")
        return member

    def consumer(self, node: PruneNode, channels: int, removed: list[int]) -> Member:
        kind = get_str(node, "type")
        if node.name not in self.modules and kind in FUNCTION_OP_TYPES:  # Add/Concat: no weights
            begin, end = get_int(node, "begin", 0), get_int(node, "end", channels)
            return Member(node.name, kind, begin, end, max((end - begin) // channels, 1), 1, "passive")
        if kind in (*OWNER_TYPES, EMBEDDING):
            return self.owner(node, kind, channels, removed)
        m, kind = self.module(node, "consumer")
        role = "passive" if isinstance(m, BATCHNORM_TYPES) or is_depthwise(m) else "consumer"
        begin, end = self.span(node, m, role, "consumer")
        if (end - begin) % channels:
            raise self.fail("consumer", node, f"spans {end - begin} positions, not a multiple of the "
                                              f"group's {channels} channels")
        member = Member(node.name, kind, begin, end, (end - begin) // channels, getattr(m, "groups", 1), role)
        idx = get_ints(node, "prune_index")
        if idx is not None and sorted(idx) != member.positions(removed):
            raise self.fail("consumer", node, "lists other removed positions than its producers imply")
        return member


def _check_producer_tiling(groups: list[PruneGroup], modules: dict[str, nn.Module]) -> None:
    """A producer's slices (one per piece of a fused projection, else one) cover all its output
    channels exactly once: a partial or overlapping slice is a record from another model."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for g in groups:
        for p in g.producers:
            spans.setdefault(p.name, []).append((p.begin, p.end))
    for name, parts in spans.items():
        size, pos = _axis_size(modules[name], "producer"), 0
        for begin, end in sorted(parts):
            if begin != pos:
                break
            pos = end
        if pos != size or len({b for b, _ in parts}) != len(parts):
            raise ValueError(f"record_file: producer {name!r} has {size} output channels, its record slices "
                             f"{sorted(parts)} do not cover them once each (record from another model?)")


def groups_from_records(record: ScaleOffsetRecord, model: nn.Module) -> list[PruneGroup]:
    """Rebuild the filter-prune groups of ``record`` for ``model`` (the original, unpruned
    model) without re-scoring; any mismatch is a ValueError naming the layer and record."""
    groups, modules, params = [], dict(model.named_modules()), dict(model.named_parameters())
    for idx, pr in enumerate(record.prune_record):
        if pr.HasField("selective_prune") or not (pr.producer or pr.consumer):
            continue  # a 2:4 mask record
        if not pr.producer:
            raise ValueError(f"record_file prune_record[{idx}] has consumers but no producer")
        reader = _Reader(modules, params, idx, pr)
        producers, channels, removed, prune_group = reader.producers()
        passive, consumers = [], []
        for node in pr.consumer:
            m = reader.consumer(node, channels, removed)
            (passive if m.role == "passive" else consumers).append(m)
        groups.append(PruneGroup(producers, consumers, passive, channels, prune_group,
                                 len(removed) / channels, False, removed))
        try:  # e.g. a grouped conv that would lose unequal numbers of channels per group
            validate_removal(model, groups[-1:])
        except ValueError as exc:
            raise ValueError(f"record_file prune_record[{idx}]: {exc} (record from another model?)") from None
    _check_producer_tiling(groups, modules)
    logger.debug("filter prune: %d groups read from the record", len(groups))
    return groups
