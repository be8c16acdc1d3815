"""Read and write record files (protobuf text format, upstream's ScaleOffsetRecord)."""

from __future__ import annotations

import logging
import os

from google.protobuf import text_format

from openamct._atomic import atomic_write_bytes
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.record.values import check_record_values

logger = logging.getLogger(__name__)


def read_record(path: str) -> ScaleOffsetRecord:
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
    record = parse_record_text(text, f"record_file {path!r}")
    missing = record.FindInitializationErrors()
    if missing:
        raise ValueError(f"record_file {path!r}: missing required fields: {', '.join(missing)}")
    check_record_values(record, f"record_file {path!r}")
    return record


# Branch point: records of at least this many characters (or bytes, encoded) are printed and
# parsed by ``large.text_writer`` / ``large.text_reader``, which give ``text_format``'s result
# byte for byte (a 250M model's record prints >15x and parses 4.7x faster). Smaller ones go
# through ``text_format`` itself.
LARGE_RECORD_BYTES = 1 << 20


def parse_record_text(text: str, what: str = "record") -> ScaleOffsetRecord:
    """The record a text holds, as ``text_format.Merge`` reads it; ``text_format`` itself for
    small records, anything outside the plain subset writers print, and for its error messages
    (line:column)."""
    record = ScaleOffsetRecord()
    if len(text) >= LARGE_RECORD_BYTES:
        from openamct.large.text_reader import Unsupported, fast_merge

        try:
            fast_merge(text, record)
            return record
        except Unsupported:
            record.Clear()
    try:
        text_format.Merge(text, record)
    except text_format.ParseError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return record


def record_to_text(record: ScaleOffsetRecord) -> str:
    """``text_format.MessageToString(record)`` (``large.text_writer`` for a large record)."""
    if record.ByteSize() >= LARGE_RECORD_BYTES:
        from openamct.large.text_writer import message_to_text

        return message_to_text(record)
    return text_format.MessageToString(record)


def write_record(path: str, record: ScaleOffsetRecord, header: str = "") -> None:
    """Write atomically: temp file in the same folder, fsync, rename. ``header``: comment lines
    (the model's fingerprint) that text-format parsers skip."""
    atomic_write_bytes(path, (header + record_to_text(record)).encode("utf-8"))
    logger.debug("record written to %s", path)
