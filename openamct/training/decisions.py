"""Which record a compressed model was built against.

Some decisions leave no trace the checkpoint could be checked against: two models of one
architecture whose filter pruning removed different channels of the same counts have the same
state-dict keys and shapes. So the model carries a digest of each such decision (a buffer in
its state dict, so every checkpoint carries it too), in record order, and

- restore refuses a checkpoint whose digests differ from the record's, naming the first layer;
- save refuses to overwrite a record file that holds other decisions than the model's (another
  model's create wrote it since), naming the first layer.

Each technique says which of its record entries are such decisions (``Technique.decisions``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn

from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.techniques.base import Technique

KEY = "openamct_decisions"  # the buffer's name on the model's root module


def of_record(techniques: Sequence[Technique], record: ScaleOffsetRecord) -> list[tuple[str, int]]:
    """(layer, 63-bit digest) of each decision ``record`` holds, in record order."""
    out = []
    for t in techniques:
        for layer, data in t.decisions(record):
            out.append((layer, int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1))
    return out


def of_model(applied: Sequence[tuple[Technique, object]], layers: dict[str, nn.Module]) -> list[tuple[str, int]]:
    """The decisions of a model just built: only the techniques that have any write their
    entries (a whole record, masks and scales included, would be built for nothing)."""
    deciding = [(t, s) for t, s in applied if type(t).decisions is not Technique.decisions]
    own = ScaleOffsetRecord()
    for technique, state in deciding:
        technique.to_record(state, layers, own)
    return of_record([t for t, _ in deciding], own)


def attach(model: nn.Module, decisions: list[tuple[str, int]]) -> None:
    if decisions:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        model.register_buffer(KEY, torch.tensor([d for _, d in decisions], dtype=torch.int64, device=device))


def _first_difference(ours: list[int], layers: list[str], theirs: list[int]) -> str | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return layers[i]
    if len(ours) != len(theirs):
        return layers[min(len(ours), len(theirs))] if len(ours) > len(theirs) else "(a decision the record lacks)"
    return None


def check_checkpoint(model: nn.Module, expected: list[tuple[str, int]], pth_file: str) -> None:
    """After the load: the checkpoint's digests (now in the buffer) against the record's."""
    if not expected or KEY not in model._buffers:
        return
    loaded = [int(v) for v in model._buffers[KEY].tolist()]
    layer = _first_difference([d for _, d in expected], [n for n, _ in expected], loaded)
    if layer is not None:
        raise ValueError(f"pth_file {pth_file!r} was trained with other decisions than record_file holds (first at "
                         f"layer {layer!r}): the record was written by another model's create since? restore "
                         "with the record saved beside this checkpoint")


def check_record_file(model: nn.Module, techniques: Sequence[Technique], path: str) -> None:
    """Before save rewrites ``path``: it must hold this model's decisions (or none yet)."""
    import os

    from openamct.record.file_io import read_record

    if KEY not in model._buffers or not os.path.isfile(path):
        return
    try:
        on_disk = of_record(techniques, read_record(path))
    except ValueError:
        return  # not a readable record: the output checks decide what may be overwritten
    ours = [int(v) for v in model._buffers[KEY].tolist()]
    layer = _first_difference([d for _, d in on_disk], [n for n, _ in on_disk], ours) if on_disk else None
    if layer is not None:
        raise ValueError(f"record_file {path!r} holds another model's decisions (first at layer {layer!r}): another "
                         "create_* wrote it since this model was made; give this model's save its own record_file")
