"""Read and write record files (protobuf text format, upstream's ScaleOffsetRecord)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf import text_format

from openamct._atomic import atomic_write_bytes
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.record.values import check_record_values

logger = logging.getLogger(__name__)

# Records of at least this many characters (or bytes, encoded) go to a ``FastText`` when the
# caller gives one; smaller ones always go through ``text_format`` itself.
LARGE_RECORD_BYTES = 1 << 20


@dataclass(frozen=True)
class FastText:
    """The record I/O's branch point: a printer and a parser of the record's text format that
    give ``text_format``'s result byte for byte, only faster (``openamct.large``'s
    ``RECORD_TEXT``: a 250M model's record prints >15x and parses 4.7x faster), when a caller
    passes one as ``fast``: printing always, parsing for texts of ``LARGE_RECORD_BYTES`` and up.

    ``merge(text, record)`` returns False for a text outside the subset it reads (``record`` is
    then cleared and ``text_format`` reads the text, and gives its error messages)."""

    print: Callable[[ScaleOffsetRecord], str]
    merge: Callable[[str, ScaleOffsetRecord], bool]


def read_record(path: str, fast: FastText | None = None) -> ScaleOffsetRecord:
    """Parse a record file; every problem is a ValueError naming the file (and line:column)."""
    if not os.path.isfile(path):
        raise ValueError(f"record_file {path!r} does not exist or is not a file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"record_file {path!r} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise ValueError(f"record_file {path!r} cannot be read: {exc}") from None
    if not raw.strip():
        raise ValueError(f"record_file {path!r} is empty ({len(raw)} bytes): it was not written by create_* "
                         "(or was cut short); run create_* again to write it")
    record = parse_record_text(text, f"record_file {path!r}", fast)
    missing = record.FindInitializationErrors()
    if missing:
        raise ValueError(f"record_file {path!r}: missing required fields: {', '.join(missing)}")
    check_record_values(record, f"record_file {path!r}")
    return record


def parse_record_text(text: str, what: str = "record", fast: FastText | None = None) -> ScaleOffsetRecord:
    """The record a text holds, as ``text_format.Merge`` reads it; ``text_format`` itself for
    small records, without ``fast``, for anything outside ``fast``'s subset, and for its error
    messages (line:column)."""
    record = ScaleOffsetRecord()
    if fast is not None and len(text) >= LARGE_RECORD_BYTES:
        if fast.merge(text, record):
            return record
        record.Clear()
    try:
        text_format.Merge(text, record)
    except text_format.ParseError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return record


def record_to_text(record: ScaleOffsetRecord, fast: FastText | None = None) -> str:
    """``text_format.MessageToString(record)``, byte for byte (``fast.print`` when given: its
    output is the same, and already at a few MB of text ``text_format`` takes a tenth of a second)."""
    if fast is not None:
        return fast.print(record)
    return text_format.MessageToString(record)


def write_record(path: str, record: ScaleOffsetRecord, header: str = "", fast: FastText | None = None) -> None:
    """Write atomically: temp file in the same folder, fsync, rename. ``header``: comment lines
    (the model's fingerprint) that text-format parsers skip."""
    atomic_write_bytes(path, (header + record_to_text(record, fast)).encode("utf-8"))
    logger.debug("record written to %s", path)
