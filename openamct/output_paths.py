"""Checks on the files a call will write, done before any work.

A call never overwrites one of its own inputs, and never overwrites a file that is not a
previous output of the same kind: a record file must parse as a ScaleOffsetRecord text, an
ONNX file as a ModelProto, a quant config as openamct's JSON (it has ``"version"``). The
folder must accept a new file (probed by creating one: permission bits say nothing when running
as root, and a read-only mount only shows on a write). A folder that does not exist yet is made
when the file is written (``folder_for``), as upstream makes the folders of its output files;
until then the nearest existing folder above it is probed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Mapping

from openamct._atomic import temp_prefix

logger = logging.getLogger(__name__)

__all__ = ["check_output", "check_path_syntax", "same_file", "probe_folder", "folder_for", "KINDS"]

KINDS = {"record": "an openamct/AMCT record file (ScaleOffsetRecord text)",
         "onnx": "an ONNX model",
         "quant_json": "a quant config JSON written by create_quant_retrain_config",
         "decompose_info": "a decomposition info JSON written by auto_decomposition"}


def check_path_syntax(arg: str, path: str) -> str:
    """The absolute path; a ValueError naming ``arg`` for '', NUL bytes, '/', a folder."""
    if not isinstance(path, str):
        raise TypeError(f"{arg} must be str, got {type(path).__name__}")
    if path == "":
        raise ValueError(f"{arg} is empty: give a file path")
    if "\0" in path:
        raise ValueError(f"{arg} {path!r} contains a NUL byte")
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise ValueError(f"{arg} {path!r} is a directory: give a file path inside it")
    return os.path.abspath(path)


def same_file(a: str, b: str) -> bool:
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def probe_folder(arg: str, path: str, make_folder: bool = False) -> None:
    """The folder of ``path`` accepts a new file (ValueError naming ``arg`` otherwise); with
    ``make_folder``, a missing folder is allowed and the nearest existing one above it is probed."""
    folder = os.path.dirname(os.path.abspath(path))
    if make_folder:  # the folder is made at write time: probe the nearest one that exists
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            raise ValueError(f"{arg} {path!r}: {folder!r} is a file, not a folder")
    if not os.path.isdir(folder):
        raise ValueError(f"{arg} {path!r}: folder {folder!r} does not exist; create it first")
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix("probe"), dir=folder)
    except OSError as exc:
        raise ValueError(f"{arg} {path!r}: folder {folder!r} is not writable ({exc.strerror or exc})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.remove(tmp)


_BIG = 64 << 20  # an ONNX file larger than this is judged by its first field, not parsed whole
# A record larger than this is judged by its first entry, not parsed whole: a 250M-parameter
# model's record (3 MB of scales) took 4 s to parse, twice per save.
_BIG_RECORD = 1 << 20
_RECORD_START = re.compile(rb"\A(?:\s*#[^\n]*\n)*\s*(?:record|prune_record)\s*\{")


def _is_kind(path: str, kind: str) -> bool:
    try:
        if kind == "onnx" and os.path.getsize(path) > _BIG:
            with open(path, "rb") as f:
                return f.read(1) == b"\x08"  # ModelProto's first field: ir_version (1, varint)
        if kind == "record" and os.path.getsize(path) > _BIG_RECORD:
            with open(path, "rb") as f:
                head = f.read(1 << 16)
            return _RECORD_START.match(head) is not None  # comment lines, then a record's first field
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return False
    if kind == "record":
        from openamct.record.file_io import parse_record_text

        try:
            parse_record_text(raw.decode("utf-8"))
        except Exception:  # any parse failure means: not a record
            return False
        return True
    if kind == "onnx":
        import onnx
        model = onnx.ModelProto()
        try:
            model.ParseFromString(raw)
        except Exception:  # protobuf's DecodeError and friends
            return False
        return model.ir_version > 0 and model.HasField("graph")
    if kind in ("quant_json", "decompose_info"):
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return False
        if kind == "decompose_info":  # a list of decomposed layers (upstream's format)
            return isinstance(data, list) and all(isinstance(e, dict) and "ori_layer_info" in e for e in data)
        return isinstance(data, dict) and "version" in data
    raise ValueError(f"unknown output kind {kind!r}")


def check_output(arg: str, path: str, kind: str, inputs: Mapping[str, str | None] | None = None,
                 make_folder: bool = False) -> str:
    """Refuse (ValueError naming ``arg``) a path that is an input of the same call, an existing
    file of another kind, or in a folder that is not writable or (unless the caller will make it,
    ``make_folder``) does not exist."""
    full = check_path_syntax(arg, path)
    for name, other in (inputs or {}).items():
        if isinstance(other, str) and other and "\0" not in other and same_file(full, other):
            raise ValueError(f"{arg} {path!r} is the same file as {name}: it would be overwritten; "
                             f"give {arg} a new path")
    probe_folder(arg, full, make_folder)
    if os.path.exists(full):
        if not os.path.isfile(full):
            raise ValueError(f"{arg} {path!r} exists and is not a regular file")
        if not _is_kind(full, kind):
            raise ValueError(f"{arg} {path!r} exists and is not {KINDS[kind]}: openamct will not overwrite "
                             "it; give a new path (or delete the file yourself)")
        if not os.access(full, os.W_OK):
            raise ValueError(f"{arg} {path!r} exists and is read-only")
    return full


@contextlib.contextmanager
def folder_for(path: str) -> Iterator[list[str]]:
    """Make the missing folders of ``path`` for the write inside the ``with``; if it fails,
    remove the ones made (deepest first, only while empty): a failed call leaves no folder."""
    made, folder = [], os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    for f in reversed(made):
        os.mkdir(f)
    try:
        yield made
    except BaseException:
        for f in made:
            with contextlib.suppress(OSError):
                os.rmdir(f)
        raise
