"""The fast record printer (openamct/record/text_writer.py) must give text_format.MessageToString's
bytes for every message the record proto can hold: the fixture records, hand-built edge cases
(presence, defaults, enums, escapes, special floats, int extremes, nesting) and a seeded fuzz; and
what it prints must parse back to the same message."""

from __future__ import annotations

import glob
import math
import os
import random
import struct

import numpy as np
import pytest
from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.internal.type_checkers import ToShortestFloat

from openamct.large import text_writer
from openamct.large.attach import RECORD_TEXT
from openamct.large.text_writer import message_to_text
from openamct.record import file_io
from openamct.record.file_io import record_to_text
from openamct.record.scale_offset_record_pb2 import (
    AttrProto,
    AttrType,
    MapFiledEntry,
    PruneNode,
    PruneRecord,
    ScaleOffsetRecord,
    SingleLayerKVCacheRecord,
    SingleLayerRecord,
)
from tests.conftest import COMPAT, ROOT

FIXTURES = sorted(glob.glob(os.path.join(COMPAT, "records", "*.txt"))
                  + glob.glob(os.path.join(ROOT, "tests", "fixtures", "golden", "*record*.txt")))
MESSAGES = [ScaleOffsetRecord, MapFiledEntry, SingleLayerRecord, SingleLayerKVCacheRecord,
            PruneRecord, PruneNode, AttrProto]


def _f32(v: float) -> float:
    """The float32 nearest v (what a float field holds)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _f32_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


F32_MAX = _f32_bits(0x7F7FFFFF)
SPECIAL_FLOATS = [_f32(v) for v in [
    0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-45, -1e-45, 3e-45, 1.1754942e-38,
    1.17549435e-38, 5.877472e-39, F32_MAX, -F32_MAX, 1.0, -1.0, 0.1, 1 / 3, 2 / 3, 0.5, 1.5, 2.5,
    1e-5, 1e-4, 9.999999e-5, 0.0001000001, 1e-3, 100.0, 1234567.0, 1234567.5, 16777216.0,
    16777217.0, 16777218.0, 33554436.0, 123456.5, 1e6, 9999999.0, 1e7, 1e10, 1e14, 1e15,
    9.999999e14, 1e16, 1.5e16, 1e20, 1e30, 1e38, 3.4e38, 1e-13, 1e-14, 1e-15, 1e-20, 1e-37,
    0.00069178914, 0.010784314, 3.0517578e-05, 6.1035156e-05, 0.007874016, 0.99999994, 1.0000001,
]]
SPECIAL_FLOATS += [_f32_bits(struct.unpack("<I", struct.pack("<f", v))[0] + d)  # neighbours
                   for v in SPECIAL_FLOATS if math.isfinite(v) for d in (-1, 1)]
STRINGS = ["", "INT8", "plain", 'quo"te', "apo'strophe", "back\\slash", "new\nline", "tab\tcr\r",
           "\x00nul", "\x01\x1f\x7f", "é café", "ß\u00ff\u0100", "中文 层", "emoji 😀 🤖", "\ufeffbom",
           "\u200bzero width", "\U0010ffff", "\ud7ff\ue000", "mixed \"'\\\n\t é 中 😀 \x02"]
BYTES = [b"", b"abc", b"\x00\x01\xff\x80", b"'\"\\\n\r\t", "é中😀".encode(), b"\xc3(", b"\xed\xa0\x80",
         bytes(range(256))]


def same(message) -> str:
    want = text_format.MessageToString(message)
    got = message_to_text(message)
    assert got == want
    return got


def _text_of(value: float) -> str:
    return str(value) if math.isnan(value) else str(ToShortestFloat(value))


# -- fixtures ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", FIXTURES, ids=os.path.basename)
def test_fixture_records(path):
    record = ScaleOffsetRecord()
    with open(path, encoding="utf-8") as f:
        text_format.Merge(f.read(), record)
    assert len(record.record) + len(record.prune_record) > 0
    text = same(record)
    assert record_to_text(record) == text


def test_record_to_text_uses_the_fast_printer_for_a_large_record(monkeypatch):
    record = ScaleOffsetRecord()
    record.record.add(key="conv").value.scale_w.extend([0.001, 0.002])
    want = text_format.MessageToString(record)
    monkeypatch.setattr(text_writer, "_float_str", lambda v: pytest.fail("fast printer for a small record"))
    assert file_io.record_to_text(record, RECORD_TEXT) == want  # below LARGE_RECORD_BYTES: text_format
    monkeypatch.undo()
    monkeypatch.setattr(file_io, "LARGE_RECORD_BYTES", 0)  # the branch point, as for a large record
    assert file_io.record_to_text(record) == want  # no fast printer given: text_format
    monkeypatch.setattr(text_format, "MessageToString", lambda *a, **k: pytest.fail("slow printer"))
    assert file_io.record_to_text(record, RECORD_TEXT) == want


# -- hand-built ----------------------------------------------------------------------------------

def full_record() -> ScaleOffsetRecord:
    record = ScaleOffsetRecord()
    entry = record.record.add(key="layer1.conv")
    v = entry.value
    v.scale_d, v.offset_d = 0.010784314, -128
    v.scale_w.extend([0.0006911092, 0.00067151285, 0.0, -0.0, 1e-45])
    v.offset_w.extend([0, -128, 127, -2 ** 31, 2 ** 31 - 1])
    v.shift_bit.extend([0, 1, 2 ** 32 - 1])
    v.tensor_balance_factor.extend([1.0, 0.5, 2.0])
    v.skip_fusion = True
    v.dst_type, v.act_type, v.wts_type, v.fakequant_precision_mode = "INT4", "INT16", "INT8", "X"
    v.scale_h, v.offset_h = 3.4028235e38, 7
    v.scale_r.extend([1e-10, 1e10])
    v.offset_r.extend([-1, 1])
    entry.kv_cache_value.scale.extend([0.25, 0.125])
    entry.kv_cache_value.offset.extend([3, -3])
    prune = record.prune_record.add()
    for i, kind in enumerate(AttrType.values()):
        node = prune.producer.add(name=f"producer{i}")
        node.attr.add(name="type", type=kind)
    attr = prune.consumer.add(name="consumer").attr
    attr.add(name="f", type=AttrType.FLOAT, f=-0.1)
    attr.add(name="i", type=AttrType.INT, i=-2 ** 63)
    attr.add(name="i", type=AttrType.INT, i=2 ** 63 - 1)
    attr.add(name="s", type=AttrType.STRING, s=b"\x00\xff quote\" back\\ \n")
    attr.add(name="fs", type=AttrType.FLOATS, floats=[1.5, -2.5, math.inf])
    attr.add(name="is", type=AttrType.INTS, ints=[0, -1, 2 ** 40])
    attr.add(name="ss", type=AttrType.STRINGS, strings=[b"a", b"", "é".encode()])
    prune.selective_prune.name = "sel"
    prune.selective_prune.attr.add()  # an empty AttrProto
    return record


def test_every_message_type_and_field():
    record = full_record()
    same(record)
    for message in [record.record[0], record.record[0].value, record.record[0].kv_cache_value,
                    record.prune_record[0], record.prune_record[0].consumer[0],
                    record.prune_record[0].consumer[0].attr[3]]:
        same(message)
    for cls in MESSAGES:
        assert message_to_text(cls()) == text_format.MessageToString(cls()) == ""


def test_every_field_is_covered():
    """full_record sets every field of every message of the proto (so the test above covers it)."""
    record = full_record()
    seen = set()

    def walk(message):
        for field, value in message.ListFields():
            seen.add(field.full_name)
            if field.message_type is not None:
                for m in (value if field.is_repeated else [value]):
                    walk(m)
    walk(record)
    for cls in MESSAGES:
        for field in cls.DESCRIPTOR.fields:
            assert field.full_name in seen, field.full_name


def test_fields_set_to_their_defaults_are_printed():
    v = SingleLayerRecord(scale_d=0.0, offset_d=0, skip_fusion=False, dst_type="INT8", act_type="",
                          scale_h=-0.0)
    assert same(v) == ('scale_d: 0.0\noffset_d: 0\nskip_fusion: false\ndst_type: "INT8"\n'
                       'act_type: ""\nscale_h: -0.0\n')
    a = AttrProto(name="", type=AttrType.UNDEFINED, f=0.0, i=0, s=b"")
    assert same(a) == 'name: ""\ntype: UNDEFINED\nf: 0.0\ni: 0\ns: ""\n'
    entry = MapFiledEntry()
    entry.value.SetInParent()
    entry.kv_cache_value.SetInParent()
    assert same(entry) == "value {\n}\nkv_cache_value {\n}\n"


def test_enums_and_unknown_fields():
    for number in AttrType.values():
        same(AttrProto(type=number))
    # a number the closed enum does not know goes to the unknown fields, which neither printer
    # prints; so do other unknown fields
    raw = AttrProto(name="x").SerializeToString() + bytes([0x10, 99]) + bytes([0xF8, 0x06, 5])
    message = AttrProto.FromString(raw)
    assert not message.HasField("type")
    assert same(message) == 'name: "x"\n'
    record = ScaleOffsetRecord.FromString(ScaleOffsetRecord(record=[MapFiledEntry(key="k")])
                                          .SerializeToString() + bytes([0x1A, 1, 0x41]))
    same(record)


@pytest.mark.parametrize("text", STRINGS)
def test_strings(text):
    same(PruneNode(name=text))
    same(MapFiledEntry(key=text, value=SingleLayerRecord(dst_type=text)))


@pytest.mark.parametrize("data", BYTES)
def test_bytes(data):
    same(AttrProto(s=data, strings=[data, data[::-1]]))


def test_special_floats_scalar_and_repeated():
    for v in SPECIAL_FLOATS:
        same(SingleLayerRecord(scale_d=v, scale_h=v))
        same(AttrProto(f=v))
    same(SingleLayerRecord(scale_w=SPECIAL_FLOATS, scale_r=SPECIAL_FLOATS[::-1]))
    same(AttrProto(floats=SPECIAL_FLOATS))


def test_ints():
    ints32 = [0, 1, -1, 127, -128, 2 ** 31 - 1, -2 ** 31, 1000000]
    same(SingleLayerRecord(offset_d=-2 ** 31, offset_h=2 ** 31 - 1, offset_w=ints32,
                           offset_r=list(range(-5, 70000, 7)), shift_bit=[0, 2 ** 32 - 1, 5]))
    same(AttrProto(i=-2 ** 63, ints=[-2 ** 63, 2 ** 63 - 1, 0, -1, 10 ** 18]))
    same(SingleLayerRecord(offset_w=[0] * 1000 + [-128] * 3 + [127]))  # a few distinct values
    for v in (0, -128, 2 ** 31 - 1):  # one value (a weight's offsets): its line repeated
        same(SingleLayerRecord(offset_w=[v] * 777, shift_bit=[2 ** 32 - 1] * 3))
    same(AttrProto(ints=[-2 ** 63] * 5))
    same(SingleLayerKVCacheRecord(offset=list(range(-40000, 40000, 3))))  # a wide span


def test_bools():
    same(SingleLayerRecord(skip_fusion=True))
    same(SingleLayerRecord(skip_fusion=False))


def test_float_values_across_the_range():
    """Every kind of float32 against str(ToShortestFloat): a few 10k, chunks split fields."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32)
    logu = 10.0 ** rng.uniform(-16, 17, 20000) * rng.choice([-1.0, 1.0], 20000)
    scales = np.abs(rng.standard_normal(20000)) * 10.0 ** rng.integers(-7, 1, 20000)
    short = np.round(rng.uniform(-1e3, 1e3, 5000) * 10.0 ** (d := rng.integers(0, 6, 5000))) / 10.0 ** d
    near = [(np.float32(10.0 ** k).view(np.uint32).astype(np.int64) + np.arange(-40, 41))
            .astype(np.uint32).view(np.float32) for k in range(-15, 17)]
    with np.errstate(invalid="ignore", over="ignore"):
        values = np.concatenate([bits.view(np.float32), logu.astype(np.float32),
                                 scales.astype(np.float32), short.astype(np.float32),
                                 np.arange(16777000, 16777300, dtype=np.float32), *near,
                                 np.array(SPECIAL_FLOATS, np.float32)]).astype(np.float64)
    values = values.tolist()
    record = ScaleOffsetRecord()
    start = 0
    for size in [1, 2, 3, 1000, 70000] + [5000] * 40:
        record.record.add(key=str(size)).value.scale_w.extend(values[start:start + size])
        start += size
    record.record.add(key="rest").value.scale_w.extend(values[start:])
    got = message_to_text(record)
    assert got == text_format.MessageToString(record)
    lines = [line.split(": ")[1] for line in got.splitlines() if "scale_w" in line]
    stored = [v for entry in record.record for v in entry.value.scale_w]
    assert lines == [_text_of(v) for v in stored]


def test_typical_values_take_the_vectorized_path(monkeypatch):
    """Scales of either sign, zeros, short decimals: none goes to text_format's per-value code."""
    rng = np.random.default_rng(5)
    values = np.concatenate([rng.standard_normal(3000) * 10.0 ** rng.integers(-9, 3, 3000),
                             np.zeros(10), -np.zeros(10), [0.5, 0.1, 0.25, -0.001, 1.0, 100.0, 1e10]])
    record = SingleLayerRecord(scale_w=values.astype(np.float32).tolist())
    want = text_format.MessageToString(record)
    monkeypatch.setattr(text_writer, "_float_str", lambda v: pytest.fail(f"per-value: {v!r}"))
    assert message_to_text(record) == want


def test_no_warnings_on_special_values():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same(SingleLayerRecord(scale_w=SPECIAL_FLOATS))


def test_small_chunks(monkeypatch):
    """Fields that span chunks, and chunks that hold several fields, come out whole and in order."""
    monkeypatch.setattr(text_writer, "_CHUNK", 7)
    rng = random.Random(3)
    record = ScaleOffsetRecord()
    for i in range(30):
        v = record.record.add(key=f"l{i}").value
        v.scale_w.extend(rng.uniform(0, 1e-3) for _ in range(rng.randrange(0, 20)))
        v.scale_r.extend(rng.uniform(-1, 1) for _ in range(rng.randrange(0, 3)))
        if rng.random() < 0.5:
            record.record[-1].kv_cache_value.scale.extend(rng.uniform(0, 9) for _ in range(3))
    same(record)


def test_digits8():
    x = np.concatenate([np.arange(10001), np.random.default_rng(1).integers(0, 10 ** 8, 20000),
                        [10 ** 8 - 1, 12345678, 99990000]]).astype(np.uint64)
    words = text_writer._digits8(x)
    assert [w.tobytes().decode() for w in words] == ["%08d" % v for v in x.tolist()]


# -- fuzz ----------------------------------------------------------------------------------------

CHARS = ([chr(c) for c in range(0, 128)] + list("éßüñ中文层😀🤖\u00ff\u0100\u200b\ufeff\U0010ffff")
         + ['"', "'", "\\", "\n"] * 5)


def _random_float(rng: random.Random) -> float:
    kind = rng.random()
    if kind < 0.3:
        return _f32_bits(rng.getrandbits(32))  # nan, inf, denormals
    if kind < 0.6:
        return _f32(abs(rng.gauss(0, 1)) * 10 ** rng.randint(-8, 2))
    if kind < 0.75:
        return rng.choice(SPECIAL_FLOATS)
    if kind < 0.9:
        return _f32(round(rng.uniform(-1e4, 1e4), rng.randint(0, 6)))
    return _f32(rng.uniform(-1, 1) * 10.0 ** rng.randint(-40, 38))


def _random_string(rng: random.Random) -> str:
    return "".join(rng.choice(CHARS) for _ in range(rng.randrange(0, 12)))


def _random_bytes(rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return _random_string(rng).encode("utf-8")
    return bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 10)))


def _random_int(rng: random.Random, bits: int, signed: bool) -> int:
    if rng.random() < 0.3:
        return rng.choice([0, -1, 1, 2 ** (bits - 1) - 1, -2 ** (bits - 1)] if signed else [0, 1, 2 ** bits - 1])
    if rng.random() < 0.5:
        return rng.randint(-200, 200) if signed else rng.randint(0, 400)
    return rng.randint(-2 ** (bits - 1), 2 ** (bits - 1) - 1) if signed else rng.randint(0, 2 ** bits - 1)


def _fill(message, rng: random.Random, depth: int = 0) -> None:
    """Each field present or not at random, with random values (repeated: 0..n of them)."""
    for field in message.DESCRIPTOR.fields:
        if rng.random() < 0.4 and not field.is_required:
            continue
        if not field.is_repeated:
            count = 1
        elif field.type == FD.TYPE_MESSAGE:
            count = rng.choice([0, 1, 2, 3])
        else:
            count = rng.choice([0, 1, 2, 5, 30, 200])
        for _ in range(count):
            t = field.type
            if t == FD.TYPE_MESSAGE:
                sub = getattr(message, field.name).add() if field.is_repeated else getattr(message, field.name)
                sub.SetInParent()
                if depth < 3:
                    _fill(sub, rng, depth + 1)
                continue
            if t == FD.TYPE_FLOAT:
                value = _random_float(rng)
            elif t == FD.TYPE_STRING:
                value = _random_string(rng)
            elif t == FD.TYPE_BYTES:
                value = _random_bytes(rng)
            elif t == FD.TYPE_BOOL:
                value = rng.random() < 0.5
            elif t == FD.TYPE_ENUM:
                value = rng.choice(field.enum_type.values).number
            else:
                bits = 64 if t in (FD.TYPE_INT64, FD.TYPE_UINT64) else 32
                value = _random_int(rng, bits, t not in (FD.TYPE_UINT32, FD.TYPE_UINT64))
            if field.is_repeated:
                getattr(message, field.name).append(value)
            else:
                setattr(message, field.name, value)


def _has_nan(text: str) -> bool:
    return any(line.endswith(": nan") for line in text.splitlines())


@pytest.mark.parametrize("seed", range(6))
def test_fuzz(seed):
    rng = random.Random(seed)
    for n in range(60):
        cls = ScaleOffsetRecord if n % 2 else rng.choice(MESSAGES)
        message = cls()
        _fill(message, rng)
        text = same(message)
        again = cls()
        text_format.Merge(text, again)  # round trip
        assert message_to_text(again) == text
        if not _has_nan(text):
            assert again == message


def test_round_trip_of_the_full_record():
    record = full_record()
    again = ScaleOffsetRecord()
    text_format.Merge(message_to_text(record), again)
    assert again == record
