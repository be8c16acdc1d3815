"""Range checks on what a record file holds, done where it is read.

Each failure is a ValueError naming the record file, the entry, the layer and the field:
scales must be finite and > 0, ``act_type`` / ``wts_type`` formats openamct quantizes with
(``openamct.formats``), offsets in the range of the activation format (weights: 0, the weight
formats are symmetric),
a layer has one quantization entry and one 2:4 mask, and a layer produces in one filter-prune
group. (Channel indices are checked against the model when the groups are replayed.)
"""

from __future__ import annotations

import math

from openamct.formats import ACTIVATION_FORMATS, WEIGHT_FORMATS
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord


def _scale_ok(v: float) -> bool:
    return math.isfinite(v) and v > 0.0


def check_record_values(record: ScaleOffsetRecord, where: str) -> None:
    keys: dict[str, int] = {}
    for i, entry in enumerate(record.record):
        at = f"{where}: record[{i}] (layer {entry.key!r})"
        if not entry.key:
            raise ValueError(f"{where}: record[{i}] has an empty key (the layer name)")
        if entry.key in keys:
            raise ValueError(f"{at} repeats the layer of record[{keys[entry.key]}]: one entry per layer")
        keys[entry.key] = i
        v = entry.value
        for field, table in (("act_type", ACTIVATION_FORMATS), ("wts_type", WEIGHT_FORMATS)):
            if getattr(v, field) not in table:
                raise ValueError(f"{at}: {field} is {getattr(v, field)!r}; openamct quantizes "
                                 f"{'activations' if field == 'act_type' else 'weights'} as {', '.join(table)}")
        act = ACTIVATION_FORMATS[v.act_type]
        if v.HasField("scale_d") and not _scale_ok(v.scale_d):
            raise ValueError(f"{at}: scale_d is {v.scale_d!r}; it must be a finite number > 0")
        if v.HasField("offset_d") and not act.qmin <= v.offset_d <= act.qmax:
            raise ValueError(f"{at}: offset_d is {v.offset_d}; it must be an {act.name} value in {act.qmin}..{act.qmax}")
        for j, s in enumerate(v.scale_w):
            if not _scale_ok(s):
                raise ValueError(f"{at}: scale_w[{j}] is {s!r}; it must be a finite number > 0")
        for j, o in enumerate(v.offset_w):
            if o != 0:
                raise ValueError(f"{at}: offset_w[{j}] is {o}; weights are quantized symmetrically, it must be 0")
        if v.offset_w and v.scale_w and len(v.offset_w) != len(v.scale_w):
            raise ValueError(f"{at}: {len(v.scale_w)} scale_w but {len(v.offset_w)} offset_w values")
    masks: dict[str, int] = {}
    producers: dict[str, int] = {}
    for i, pr in enumerate(record.prune_record):
        if pr.HasField("selective_prune"):
            name = pr.selective_prune.name
            algo = next((a.s for a in pr.selective_prune.attr if a.name == "algorithm"), b"")
            # One module may hold one entry per role (activation_quant: a wrapped SiLU's quantizers
            # and, when a quantized layer and residual Adds read its output, a "residual" entry).
            op = next((a.s for a in pr.selective_prune.attr if a.name == "op"), b"")
            key = f"{algo!r}:{op!r}:{name}"
            if key in masks:
                what = f" {op.decode(errors='replace')}" if op else ""
                raise ValueError(f"{where}: prune_record[{i}] (selective_prune{what} {name!r}) repeats the entry of "
                                 f"prune_record[{masks[key]}]: one entry per layer and role")
            masks[key] = i
            continue
        for node in pr.producer:
            if node.name in producers and producers[node.name] != i:
                raise ValueError(f"{where}: prune_record[{i}] (producer {node.name!r}) repeats the layer of "
                                 f"prune_record[{producers[node.name]}]: a layer is pruned in one group only")
            producers[node.name] = i
