"""The fast record parser (openamct/record/text_reader.py) must build exactly the message
text_format.Merge builds, for everything a writer prints (the fixture records, every field of
the proto, escapes, special floats, int extremes, a fuzz), and must hand everything outside its
plain subset to text_format (which then gives the same message or its own error)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from google.protobuf import text_format

from openamct.large.attach import RECORD_TEXT
from openamct.large.text_reader import Unsupported, fast_merge
from openamct.large.text_writer import message_to_text
from openamct.record import file_io
from openamct.record.file_io import parse_record_text, read_record
from openamct.record.scale_offset_record_pb2 import (
    AttrProto,
    MapFiledEntry,
    PruneNode,
    ScaleOffsetRecord,
    SingleLayerRecord,
)
from tests.unit.test_record_text_writer import BYTES, FIXTURES, SPECIAL_FLOATS, STRINGS, full_record


def _both(text: str, cls=ScaleOffsetRecord):
    fast, slow = cls(), cls()
    fast_merge(text, fast)
    text_format.Merge(text, slow)
    assert fast.SerializeToString(deterministic=True) == slow.SerializeToString(deterministic=True)
    return fast


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.rsplit("/", 1)[-1])
def test_fixture_records(path):
    with open(path, encoding="utf-8") as f:
        record = _both(f.read())
    assert len(record.record) + len(record.prune_record) > 0


def test_every_field_and_empty_messages():
    _both(message_to_text(full_record()))
    entry = MapFiledEntry()
    entry.value.SetInParent()
    got = _both(message_to_text(entry), MapFiledEntry)
    assert got.HasField("value") and not got.HasField("kv_cache_value")


@pytest.mark.parametrize("text", STRINGS)
def test_strings(text):
    _both(message_to_text(PruneNode(name=text)), PruneNode)
    _both(message_to_text(MapFiledEntry(key=text, value=SingleLayerRecord(dst_type=text))), MapFiledEntry)


@pytest.mark.parametrize("data", BYTES)
def test_bytes(data):
    _both(message_to_text(AttrProto(s=data, strings=[data, data[::-1]])), AttrProto)


def test_special_floats_and_int_extremes():
    _both(message_to_text(SingleLayerRecord(scale_w=SPECIAL_FLOATS, scale_d=SPECIAL_FLOATS[3])), SingleLayerRecord)
    _both(message_to_text(AttrProto(floats=SPECIAL_FLOATS, i=-2 ** 63, ints=[-2 ** 63, 2 ** 63 - 1, 0])), AttrProto)
    _both(message_to_text(SingleLayerRecord(offset_w=[-2 ** 31, 2 ** 31 - 1], shift_bit=[0, 2 ** 32 - 1])),
          SingleLayerRecord)


def test_what_hand_written_records_hold():
    """Comments, `value: {`, adjacent strings, enums by number, other float spellings, fields
    given twice (Merge: the last wins), repeated fields interleaved."""
    text = ('# header\nrecord { key: "a" "b" value: { scale_d: 1E-5 offset_d: -0 scale_w: 1 scale_w: .5\n'
            'offset_w: 3 scale_w: -2.5e+3 scale_d: 2 skip_fusion: true } }  # trailing\n'
            'prune_record { selective_prune { name: "n" attr { name: "t" type: 5 ints: 1 ints: -1 } } }\n'
            'record { key: "c" value { scale_w: inf scale_w: -inf scale_w: nan } }\n')
    got = _both(text)
    assert got.record[0].key == "ab" and got.record[0].value.scale_d == 2.0
    assert list(got.record[0].value.scale_w) == [1.0, 0.5, -2500.0]
    escapes = _both('prune_record { selective_prune { name: "a\\x41\\101\\n\\"" } }')
    assert escapes.prune_record[0].selective_prune.name == 'aAA\n"'


@pytest.mark.parametrize("text", [
    "record { value { scale_w: [1, 2] } }",  # list syntax
    "record < key: 'x' >",  # angle brackets, single quotes
    "record { value { offset_d: 0x10 } }",  # hex
    "record { value { offset_d: 017 } }",  # octal: 15 for text_format, 17 for int()
    "record { value { scale_d: 1.5f } }",
    "record { value { scale_d: 1; offset_d: 2 } }",
    "record { value { skip_fusion: t } }",
    "record { value { scale_d: infinity } }",
])
def test_other_syntax_goes_to_text_format_with_the_same_result(text):
    with pytest.raises(Unsupported):
        fast_merge(text, ScaleOffsetRecord())
    want = ScaleOffsetRecord()
    try:
        text_format.Merge(text, want)
    except text_format.ParseError as exc:
        with pytest.raises(ValueError, match=str(exc).split(":")[0]):
            parse_record_text(text, fast=RECORD_TEXT)
        return
    assert parse_record_text(text, fast=RECORD_TEXT).SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


@pytest.mark.parametrize("text", [
    "record { key: \"a\" value { offset_d: 99999999999 } }",  # out of int32 range
    "record { key: \"a\" value { no_such_field: 1 } }",
    "record { key: \"a\" value { scale_d: 1 }",  # unclosed
    "record { key: \"a\" } }",
    "record { value { scale_d: } }",
])
def test_bad_records_get_text_formats_error_with_its_line_and_column(text, tmp_path, monkeypatch):
    monkeypatch.setattr(file_io, "LARGE_RECORD_BYTES", 0)  # the branch point, as for a large record
    with pytest.raises(Unsupported):
        fast_merge(text, ScaleOffsetRecord())
    with pytest.raises(text_format.ParseError) as want:
        text_format.Merge(text, ScaleOffsetRecord())
    path = tmp_path / "rec.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as got:
        read_record(str(path), RECORD_TEXT)
    assert str(want.value) in str(got.value) and "rec.txt" in str(got.value)


def test_read_record_takes_the_fast_path(tmp_path, monkeypatch):
    record = full_record()
    path = tmp_path / "rec.txt"
    path.write_text("# openamct-fingerprint: x\n" + message_to_text(record))
    want = ScaleOffsetRecord()
    text_format.Merge(path.read_text(), want)
    monkeypatch.setattr(file_io, "LARGE_RECORD_BYTES", 0)  # the branch point, as for a large record
    monkeypatch.setattr(file_io.text_format, "Merge", lambda *a, **k: pytest.fail("slow parser"))
    got = parse_record_text(path.read_text(), fast=RECORD_TEXT)
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


def test_fuzz_against_text_format():
    """Random records of layer entries, masks and attrs, as the writer prints them."""
    rng = random.Random(11)
    nrng = np.random.default_rng(11)
    for _ in range(30):
        record = ScaleOffsetRecord()
        for k in range(rng.randint(0, 5)):
            v = record.record.add(key=f"layer{k}.{rng.choice(STRINGS)}").value
            n = rng.randint(0, 300)
            v.scale_w.extend((nrng.standard_normal(n) * 10.0 ** nrng.integers(-9, 3, n)).astype(np.float32).tolist())
            v.offset_w.extend(nrng.integers(-128, 128, n).tolist())
            if rng.random() < 0.5:
                v.scale_d, v.offset_d = rng.choice(SPECIAL_FLOATS), rng.randint(-2 ** 31, 2 ** 31 - 1)
            if rng.random() < 0.3:
                v.dst_type = rng.choice(STRINGS)
        for _ in range(rng.randint(0, 3)):
            node = record.prune_record.add().selective_prune
            node.name = rng.choice(STRINGS)
            node.attr.add(name="mask_shape", type=5, ints=[rng.randint(1, 9) for _ in range(rng.randint(1, 4))])
            node.attr.add(name="selective_mask", type=5, ints=nrng.integers(-2 ** 63, 2 ** 63 - 1, 20).tolist())
            node.attr.add(name="s", type=3, s=rng.choice(BYTES))
        _both(message_to_text(record))
