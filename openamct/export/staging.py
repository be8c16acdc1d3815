"""Stage the two files of one save on disk, then stamp them with the pair's id and move them
into place (issue 19: at most one model's proto in memory, and the fake-quant model's weights
never loaded back at all).

Two ways in:
- ``Staged(proto, ...)``: a model built in memory (the deploy model after its post-pass).
- ``stage_export(file, ...)``: a file the exporter wrote (the fake-quant model). Below 2 GB
  it is used as written; above, the exporter writes one file per tensor, and these are
  concatenated, one tensor at a time, into the single ``<file>.data`` that save promises.

The save id goes in last: appending a serialized ``ModelProto`` that holds only the
``metadata_props`` entry to the file is protobuf's merge, and gives the same bytes as
serializing the stamped proto as long as ``metadata_props`` (field 14) is the last field
present. That holds for the TorchScript exporter's models, which never carry ``training_info``
or ``functions`` here (no onnxscript functions, no ``export_modules_as_functions``); a proto
that has them is kept and written whole at the end.
"""

from __future__ import annotations

import logging
import os
import shutil

import onnx

from openamct._atomic import atomic_path

logger = logging.getLogger(__name__)

__all__ = ["SAVE_ID_KEY", "Staged", "stage_export", "tensor_bytes", "hash_model"]

SAVE_ID_KEY = "openamct_save_id"  # metadata_props key: the two files of one save carry one id
_ALIGN = 4096  # external tensors start on a page: ONNX Runtime can map them instead of reading
_CHUNK = 1 << 24


def tensor_bytes(model: onnx.ModelProto) -> int:
    total = sum(len(t.raw_data) for t in model.graph.initializer)
    return total + sum(len(a.t.raw_data) for n in model.graph.node for a in n.attribute if a.HasField("t"))


def hash_model(h, model: onnx.ModelProto) -> None:
    """Feed one in-memory model of a save into the pair's id."""
    g = model.graph
    for part in (*g.node, *g.input, *g.output):
        h.update(part.SerializeToString(deterministic=True))
    for t in g.initializer:
        h.update(t.name.encode())
        h.update(repr(tuple(t.dims)).encode())
        h.update(t.raw_data)
    h.update(b"\0")


def _hash_file(h, path: str) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    h.update(b"\0")


def _stamp_tail(save_id: str) -> bytes:
    tail = onnx.ModelProto()
    entry = tail.metadata_props.add()
    entry.key, entry.value = SAVE_ID_KEY, save_id
    return tail.SerializeToString()


class Staged:
    """One model written to a staging folder now, stamped and moved into place by ``finish``."""

    def __init__(self, model: onnx.ModelProto | None, path: str, stage: str, external_threshold: int,
                 h=None) -> None:
        self.path, self.base = path, os.path.basename(path)
        self.staged = os.path.join(stage, self.base)
        self.external, self.kept = False, None
        if model is None:  # stage_export fills in the rest
            return
        if h is not None:
            hash_model(h, model)
        self.external = tensor_bytes(model) > external_threshold
        if model.training_info or model.functions:
            self.kept = model
            return
        if self.external:
            # The proto is not used again: onnx may move its tensors out (no copy).
            onnx.save_model(model, self.staged, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=self.base + ".data", size_threshold=1024)
        else:
            with open(self.staged, "wb") as f:
                f.write(model.SerializeToString())

    def finish(self, save_id: str) -> None:
        from openamct.export.writer import EXTERNAL_DATA_BYTES, write_onnx

        if self.kept is not None:
            entry = self.kept.metadata_props.add()
            entry.key, entry.value = SAVE_ID_KEY, save_id
            write_onnx(self.kept, self.path, 0 if self.external else EXTERNAL_DATA_BYTES)
            return
        with open(self.staged, "ab") as f:
            f.write(_stamp_tail(save_id))
        folder = os.path.dirname(os.path.abspath(self.path))
        names = (self.base + ".data", self.base) if self.external else (self.base,)
        for name in names:  # data first: the model file must never point at nothing
            with atomic_path(os.path.join(folder, name)) as target:
                shutil.move(os.path.join(os.path.dirname(self.staged), name), target)
        if self.external:
            logger.info("%s: written with external data %s", self.path, self.base + ".data")


def stage_export(file: str, path: str, stage: str, external_threshold: int, h) -> Staged:
    """Stage the exporter's ``file`` (alone in its folder, with its tensor files if any) as
    ``path``, feeding its content into ``h``."""
    folder = os.path.dirname(file)
    tensor_files = [f for f in os.listdir(folder) if f != os.path.basename(file)]
    if not tensor_files and os.path.getsize(file) > external_threshold:
        # Written whole but above our threshold (tests, or the last 64 MB below 2 GB): convert.
        return Staged(onnx.load(file), path, stage, external_threshold, h)
    out = Staged(None, path, stage, external_threshold)
    if not tensor_files:
        shutil.move(file, out.staged)
        _hash_file(h, out.staged)
        return out
    proto = onnx.load(file, load_external_data=False)
    _merge_external(proto, folder, os.path.join(stage, out.base + ".data"), out.base + ".data", h)
    hash_model(h, proto)
    with open(out.staged, "wb") as f:
        f.write(proto.SerializeToString())
    out.external = True
    return out


def _all_tensors(graph: onnx.GraphProto):
    """Initializers and tensors held in node attributes (a Constant's value: the exporter
    moves those out too), subgraphs included."""
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


def _merge_external(proto: onnx.ModelProto, folder: str, data_path: str, location: str, h) -> None:
    """Copy every external tensor's bytes into ``data_path`` (page-aligned, in graph order),
    point the tensors at it, and delete each source file once copied (the exporter
    writes one per tensor), so the disk never holds the weights twice over."""
    external = [t for t in _all_tensors(proto.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    sources = [{e.key: e.value for e in t.external_data} for t in external]
    left = {}
    for info in sources:
        left[info["location"]] = left.get(info["location"], 0) + 1
    offset = 0
    with open(data_path, "wb") as out:
        for t, info in zip(external, sources):
            pad = -offset % _ALIGN
            out.write(bytes(pad))
            offset += pad
            src = os.path.join(folder, info["location"])
            remaining = int(info["length"]) if "length" in info else os.path.getsize(src) - int(info.get("offset", 0))
            length = remaining
            with open(src, "rb") as f:
                f.seek(int(info.get("offset", 0)))
                while remaining > 0:
                    chunk = f.read(min(_CHUNK, remaining))
                    if not chunk:
                        raise ValueError(f"export: tensor file {info['location']!r} is shorter than its tensor")
                    out.write(chunk)
                    h.update(chunk)
                    remaining -= len(chunk)
            left[info["location"]] -= 1
            if not left[info["location"]]:
                os.remove(src)
            del t.external_data[:]
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            offset += length
