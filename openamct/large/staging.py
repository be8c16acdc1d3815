"""Stage the two files of one save on disk, then stamp them with the pair's id and move them
into place (one model's small proto in memory at a time, and no folded weight held
beyond the one being written).

``stage_streamed(proto, deferred, ...)`` takes a model exported with placeholder weights
(``deferred.py``) and computes and writes each weight one at a time. Below 2 GB each goes into
the model file as a serialised ``ModelProto`` of its own holding just that initializer, which
protobuf's merge rule appends to the graph's initializers; above, into ``<file>.data``, each
tensor page-aligned so ONNX Runtime can map it.

The save id goes in last, the same way: a serialized ``ModelProto`` holding only the
``metadata_props`` entry, appended to the file (a repeated field: merged by appending).
"""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import onnx

from openamct._atomic import atomic_path
from openamct.export.element_types import STORAGE_ONNX_TYPES
from openamct.export.ids import SAVE_ID_KEY, hash_model, tensor_bytes
from openamct.large.deferred import DeferredWeight, WriteScratch, strip_placeholders

logger = logging.getLogger(__name__)

__all__ = ["Staged", "stage_streamed"]

_ALIGN = 4096  # external tensors start on a page: ONNX Runtime can map them instead of reading


def _stamp_tail(save_id: str) -> bytes:
    tail = onnx.ModelProto()
    entry = tail.metadata_props.add()
    entry.key, entry.value = SAVE_ID_KEY, save_id
    return tail.SerializeToString()


class Staged:
    """One model in a staging folder (``staged``, and ``<base>.data`` beside it when
    ``external``), stamped and moved into place by ``finish``."""

    def __init__(self, path: str, stage: str, external: bool) -> None:
        self.path, self.base = path, os.path.basename(path)
        self.staged = os.path.join(stage, self.base)
        self.external = external

    def finish(self, save_id: str) -> None:
        with open(self.staged, "ab") as f:
            f.write(_stamp_tail(save_id))
        folder = os.path.dirname(os.path.abspath(self.path))
        names = (self.base + ".data", self.base) if self.external else (self.base,)
        for name in names:  # data first: the model file must never point at nothing
            with atomic_path(os.path.join(folder, name)) as target:
                shutil.move(os.path.join(os.path.dirname(self.staged), name), target)
        if self.external:
            logger.info("%s: written with external data %s", self.path, self.base + ".data")


def stage_streamed(model: onnx.ModelProto, deferred: dict[str, DeferredWeight], order: list[str], path: str,
                   stage: str, external_threshold: int, h) -> Staged:
    """Stage ``model`` (its placeholder nodes bound, ``deferred.bind_placeholders``) as ``path``,
    with each deferred weight computed and written one at a time, as an initializer of that
    name, placed among the others by ``order`` (``export_layer.deferred_weights``); feeds the
    content into ``h``. Memory: the model without those weights, plus one of them."""
    strip_placeholders(model)
    scratch = WriteScratch()
    out = Staged(path, stage, tensor_bytes(model) + sum(d.nbytes for d in deferred.values()) > external_threshold)
    hash_model(h, model)
    g = model.graph
    if out.external:
        with open(os.path.join(stage, out.base + ".data"), "wb") as data:
            writer = _DataWriter(data, out.base + ".data")
            for t in _all_tensors(g):
                if len(t.raw_data) > 1024:
                    writer.move_out(t)
            kept = {t.name: t.SerializeToString() for t in g.initializer}  # small now
            del g.initializer[:]
            for name in _merged_order(list(kept), deferred, order):
                if name in kept:
                    g.initializer.add().ParseFromString(kept.pop(name))
                else:
                    stub = _header(name, deferred[name])
                    writer.write(stub, _computed(deferred[name], name, h, scratch))
                    g.initializer.append(stub)
        with open(out.staged, "wb") as f:
            f.write(model.SerializeToString())
        return out
    kept = {t.name: t for t in g.initializer}
    with open(out.staged, "wb") as f:
        f.write(_without_initializers(model).SerializeToString())
        # Each initializer after the model as a ModelProto{graph{initializer: [tensor]}} of its
        # own: a parser merges repeated occurrences of the (singular) graph field and appends
        # to its repeated initializers in file order (protobuf's merge rule), so the file reads
        # as the one model, initializers in ``order``. One tensor's bytes at a time.
        for name in _merged_order(list(kept), deferred, order):
            if name in kept:
                tensor = kept.pop(name).SerializeToString()
                f.write(_graph_chunk(len(tensor)) + tensor)
                del tensor
                continue
            header = _header(name, deferred[name]).SerializeToString()
            raw = _computed(deferred[name], name, h, scratch)
            n = raw.nbytes
            tail = b"\x4a" + _varint(n)  # raw_data, field 9
            f.write(_graph_chunk(len(header) + len(tail) + n) + header + tail)
            f.write(raw.data)
    return out


def _copy_fields(src, dst, skip: str) -> None:
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if isinstance(value, (str, bytes, int, float)):
            setattr(dst, fd.name, value)
        elif hasattr(value, "extend"):
            getattr(dst, fd.name).extend(value)
        else:
            getattr(dst, fd.name).CopyFrom(value)


def _without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without its graph's initializers (never copied: they may be large)."""
    out = onnx.ModelProto()
    _copy_fields(model, out, "graph")
    _copy_fields(model.graph, out.graph, "initializer")
    return out


def _graph_chunk(tensor_len: int) -> bytes:
    """The bytes before a serialized TensorProto of ``tensor_len`` bytes that make it
    ModelProto.graph (field 7) .initializer (field 5)."""
    graph_len = 1 + len(_varint(tensor_len)) + tensor_len
    return b"\x3a" + _varint(graph_len) + b"\x2a" + _varint(tensor_len)


def _merged_order(kept: list[str], deferred: dict[str, DeferredWeight], order: list[str]) -> list[str]:
    """``kept`` in its order, each deferred weight just before the first kept initializer that
    ``order`` puts after it (the rest, e.g. the exporter's folded constants, stay where they are)."""
    pos = {n: i for i, n in enumerate(order)}
    pending = sorted(deferred, key=lambda n: pos.get(n, len(pos)))
    out = []
    for name in kept:
        if name in pos:
            while pending and pos.get(pending[0], len(pos)) < pos[name]:
                out.append(pending.pop(0))
        out.append(name)
    return out + pending




def _header(name: str, d: DeferredWeight) -> onnx.TensorProto:
    return onnx.TensorProto(name=name, dims=list(d.stored_shape), data_type=STORAGE_ONNX_TYPES[d.dtype])


def _computed(d: DeferredWeight, name: str, h, scratch: WriteScratch) -> np.ndarray:
    t = d.compute(scratch)
    if tuple(t.shape) != d.stored_shape or t.dtype != d.dtype:
        raise ValueError(f"export: folded weight {name!r} came out {tuple(t.shape)} {t.dtype}, "
                         f"traced as {d.stored_shape} {d.dtype}")
    raw = t.numpy()
    h.update(name.encode())
    h.update(repr(tuple(raw.shape)).encode())
    h.update(raw.data)
    return raw


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


class _DataWriter:
    """Appends tensors to one ``.data`` file, each on a page boundary, and points them at it."""

    def __init__(self, f, location: str) -> None:
        self.f, self.location, self.offset = f, location, 0

    def write(self, tensor: onnx.TensorProto, raw) -> None:
        pad = -self.offset % _ALIGN
        self.f.write(bytes(pad))
        self.offset += pad
        length = memoryview(raw).nbytes
        self.f.write(raw.data if isinstance(raw, np.ndarray) else raw)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", self.location), ("offset", str(self.offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.offset += length

    def move_out(self, tensor: onnx.TensorProto) -> None:
        raw = tensor.raw_data
        tensor.ClearField("raw_data")
        self.write(tensor, raw)


def _all_tensors(graph: onnx.GraphProto):
    """Initializers and tensors held in node attributes (a Constant's value), subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("g"):
                yield from _all_tensors(a.g)
            for g in a.graphs:
                yield from _all_tensors(g)
