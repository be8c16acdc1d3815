"""The decomposition info file: which convs were split, how, at which rank.

The format is upstream AMCT's, so either tool reads the other's file: a JSON list, one object
per decomposed conv::

    {"version": 1,
     "ori_layer_info": {"name": "layer4.0", "in_channels": 64, "out_channels": 128,
                        "kernel_size": [3, 3], "stride": [2, 2], "dilation": [1, 1], "groups": 1,
                        "padding": [1, 1], "bias": false, "padding_mode": "zeros"},
     "mode": "SCFK",
     "decom_nodes": {"first": {"weight_shape": [32, 64, 3, 1]},
                     "last": {"weight_shape": [128, 32, 1, 3]}}}

``version``, ``padding``, ``bias`` and ``padding_mode`` are openamct's additions (upstream's
reader ignores them; an upstream file without them is checked on the fields it has). A file
with a newer ``version`` is refused rather than misread. The file is written atomically.
"""

from __future__ import annotations

import json
import os

from torch import nn

from openamct._atomic import atomic_path
from openamct.tensor_decompose.factor import MODES, vertical_first

__all__ = ["VERSION", "layer_info", "entry", "write_info", "read_info", "check_entry", "looks_like_info"]

VERSION = 1


def _pair(v) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(x) for x in v]


def layer_info(name: str, conv: nn.Conv2d) -> dict:
    return {"name": name, "in_channels": conv.in_channels, "out_channels": conv.out_channels,
            "kernel_size": _pair(conv.kernel_size), "stride": _pair(conv.stride),
            "dilation": _pair(conv.dilation), "groups": conv.groups,
            "padding": conv.padding if isinstance(conv.padding, str) else _pair(conv.padding),
            "bias": conv.bias is not None, "padding_mode": conv.padding_mode}


def entry(name: str, conv: nn.Conv2d, mode: str, first_shape, last_shape) -> dict:
    return {"version": VERSION, "ori_layer_info": layer_info(name, conv), "mode": mode,
            "decom_nodes": {"first": {"weight_shape": [int(d) for d in first_shape]},
                            "last": {"weight_shape": [int(d) for d in last_shape]}}}


def write_info(path: str, entries: list[dict]) -> None:
    text = json.dumps(entries, indent="\t") + "\n"
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def looks_like_info(data) -> bool:
    """A decomposition info file's content (openamct's or upstream's)."""
    return isinstance(data, list) and all(isinstance(e, dict) and "ori_layer_info" in e for e in data)


def read_info(path: str) -> list[dict]:
    """The entries of ``path``; ValueError naming the file and the problem."""
    arg = f"decompose_info_path {path!r}"
    if not os.path.isfile(path):
        raise ValueError(f"{arg} does not exist or is not a file")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"{arg} is not UTF-8 text: not a decomposition info file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{arg} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, list):
        raise ValueError(f"{arg} holds a JSON {type(data).__name__}, not the list of decomposed layers "
                         "that auto_decomposition writes")
    seen = set()
    for i, e in enumerate(data):
        where = f"{arg} entry {i}"
        if not isinstance(e, dict) or not isinstance(e.get("ori_layer_info"), dict):
            raise ValueError(f"{where} has no 'ori_layer_info' object: not a decomposition info file")
        version = e.get("version", VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"{where}: 'version' must be a positive integer, got {version!r}")
        if version > VERSION:
            raise ValueError(f"{where} has version {version}, written by a newer openamct; this one reads "
                             f"version {VERSION}")
        name = e["ori_layer_info"].get("name")
        if not isinstance(name, str):
            raise ValueError(f"{where}: 'ori_layer_info.name' must be a string, got {name!r}")
        if name in seen:
            raise ValueError(f"{where}: layer {name!r} is listed twice")
        seen.add(name)
        if e.get("mode") not in MODES:
            raise ValueError(f"{where} (layer {name!r}): 'mode' must be one of {', '.join(MODES)}, "
                             f"got {e.get('mode')!r}")
    return data


def _shape(e: dict, pos: str, where: str) -> list[int]:
    try:
        shape = e["decom_nodes"][pos]["weight_shape"]
    except (KeyError, TypeError):
        raise ValueError(f"{where}: 'decom_nodes.{pos}.weight_shape' is missing") from None
    if (not isinstance(shape, list) or len(shape) != 4
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
        raise ValueError(f"{where}: 'decom_nodes.{pos}.weight_shape' must be 4 integers, got {shape!r}")
    return shape


def check_entry(e: dict, conv: nn.Module, path: str) -> int:
    """Check one entry against the model's conv of that name; returns the rank. The error
    names the layer, the field, the file's value and the model's."""
    info = e["ori_layer_info"]
    name = info["name"]
    where = f"decompose_info_path {path!r}, layer {name!r}"
    if type(conv) is not nn.Conv2d:
        hint = " (was the model decomposed already?)" if isinstance(conv, nn.Sequential) else ""
        raise ValueError(f"{where}: the model's layer is {type(conv).__name__}, not torch.nn.Conv2d{hint}")
    now = layer_info(name, conv)
    for key in ("in_channels", "out_channels", "kernel_size", "stride", "dilation", "groups", "padding", "bias",
                "padding_mode"):
        if key not in info and key in ("padding", "bias", "padding_mode"):
            continue  # openamct's additions: an upstream file lacks them
        if info.get(key) != now[key]:
            raise ValueError(f"{where}: {key} is {info.get(key)!r} in the file but {now[key]!r} in the model: "
                             "the file describes another model")
    if conv.groups != 1 or now["dilation"] != [1, 1]:
        raise ValueError(f"{where}: a grouped or dilated conv cannot be split into two convs")
    first, last = _shape(e, "first", where), _shape(e, "last", where)
    rank = first[0]
    kh, kw = now["kernel_size"]
    vertical = vertical_first(e["mode"])
    want_first = [rank, conv.in_channels, kh, 1] if vertical else [rank, conv.in_channels, 1, kw]
    want_last = [conv.out_channels, rank, 1, kw] if vertical else [conv.out_channels, rank, kh, 1]
    if first != want_first or last != want_last:
        raise ValueError(f"{where}: weight shapes {first} and {last} do not fit mode {e['mode']} of a conv "
                         f"{conv.out_channels}x{conv.in_channels}x{kh}x{kw} (want {want_first} and {want_last})")
    rows = conv.in_channels * (kh if vertical else kw)
    cols = conv.out_channels * (kw if vertical else kh)
    if not 1 <= rank <= min(rows, cols):
        raise ValueError(f"{where}: rank {rank} is larger than the layer allows (1..{min(rows, cols)}, "
                         f"its unfolded weight is {rows}x{cols})" if rank > 0 else
                         f"{where}: rank {rank} must be at least 1")
    return rank
