"""The id both files of one save carry, and the size of a model's tensors (``writer.py``)."""

from __future__ import annotations

import onnx

__all__ = ["SAVE_ID_KEY", "tensor_bytes", "hash_model"]

SAVE_ID_KEY = "openamct_save_id"  # metadata_props key: the two files of one save carry one id


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
