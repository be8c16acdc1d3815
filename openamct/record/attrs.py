"""Typed access to the ONNX-style attributes that prune records carry."""

from __future__ import annotations

from collections.abc import Iterable

from openamct.record.scale_offset_record_pb2 import AttrProto, AttrType, PruneNode


def add_int(node: PruneNode, name: str, value: int) -> None:
    node.attr.add(name=name, type=AttrType.INT, i=int(value))


def add_ints(node: PruneNode, name: str, values: Iterable[int]) -> None:
    node.attr.add(name=name, type=AttrType.INTS, ints=[int(v) for v in values])


def add_str(node: PruneNode, name: str, value: str) -> None:
    node.attr.add(name=name, type=AttrType.STRING, s=value.encode("utf-8"))


def find(node: PruneNode, name: str) -> AttrProto | None:
    for attr in node.attr:
        if attr.name == name:
            return attr
    return None


def _typed(node: PruneNode, name: str, kind: int, kind_name: str) -> AttrProto | None:
    attr = find(node, name)
    if attr is not None and attr.type != kind:
        raise ValueError(f"record node {node.name!r}: attr {name!r} must be {kind_name}")
    return attr


def get_int(node: PruneNode, name: str, default: int | None = None) -> int | None:
    attr = _typed(node, name, AttrType.INT, "INT")
    return default if attr is None else int(attr.i)


def get_ints(node: PruneNode, name: str) -> list[int] | None:
    attr = _typed(node, name, AttrType.INTS, "INTS")
    return None if attr is None else [int(v) for v in attr.ints]


def get_str(node: PruneNode, name: str, default: str | None = None) -> str | None:
    attr = _typed(node, name, AttrType.STRING, "STRING")
    return default if attr is None else attr.s.decode("utf-8", errors="replace")
