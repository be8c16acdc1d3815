"""Record files: upstream records parse, ours round-trip, writes are atomic."""

import glob
import os

import pytest

from openamct.record import attrs
from openamct.record.file_io import read_record, write_record
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from tests.conftest import COMPAT

RECORDS = sorted(glob.glob(os.path.join(COMPAT, "records", "*.txt")))


@pytest.mark.parametrize("path", RECORDS, ids=os.path.basename)
def test_upstream_records_parse_and_round_trip(path, tmp_path):
    record = read_record(path)
    assert len(record.prune_record) >= 1
    out = tmp_path / "r.txt"
    write_record(str(out), record)
    assert read_record(str(out)) == record


def test_eltwise_record_has_one_group_with_several_producers():
    record = read_record(os.path.join(COMPAT, "records", "record_EltwiseConv.txt"))
    (pr,) = record.prune_record
    assert [p.name for p in pr.producer] == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    assert attrs.get_int(pr.producer[0], "end") == 160
    assert attrs.get_int(pr.producer[0], "prune_group") == 2


def test_prune_index_is_read_as_ints():
    record = read_record(os.path.join(COMPAT, "records", "record_NetTrainBranch.txt"))
    assert attrs.get_ints(record.prune_record[0].producer[0], "prune_index") == [1, 6, 13, 14]


def test_quant_entry_round_trip(tmp_path):
    record = ScaleOffsetRecord()
    v = record.record.add(key="conv1").value
    v.scale_d, v.offset_d = 0.0125, -128
    v.scale_w.extend([0.1, 0.2])
    v.offset_w.extend([0, 0])
    write_record(str(tmp_path / "r.txt"), record)
    back = read_record(str(tmp_path / "r.txt"))
    assert back.record[0].key == "conv1" and back.record[0].value.offset_d == -128
    assert back.record[0].value.dst_type == "INT8"  # upstream default


def test_garbage_and_truncated_records_are_value_errors(tmp_path):
    good = open(RECORDS[0]).read()
    p = tmp_path / "bad.txt"
    p.write_text(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"bad.txt"):
        read_record(str(p))
    p.write_bytes(b"\x80\x81 not text")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_record(str(p))
    with pytest.raises(ValueError, match="does not exist"):
        read_record(str(tmp_path / "missing.txt"))


def test_failed_write_leaves_old_record_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "r.txt"
    record = read_record(RECORDS[0])
    write_record(str(path), record)
    before = path.read_bytes()

    import openamct._atomic as atomic

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_record(str(path), ScaleOffsetRecord())
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["r.txt"]
