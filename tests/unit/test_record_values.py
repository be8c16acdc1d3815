"""A record's values are checked where they are read;
each bad one is a ValueError naming the record file, the entry, the layer and the field."""

from __future__ import annotations

import pytest
import torch

import openamct as amct
from openamct.record.file_io import read_record, record_to_text
from tests.trained_record import Net, X, compress_and_train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("rv")
    compress_and_train(d)
    return d, read_record(str(d / "rec.txt"))


def _restore(d, record):
    path = d / "bad.txt"
    path.write_text(record_to_text(record) if not isinstance(record, str) else record)
    return amct.restore_compressed_retrain_model(Net(), X, str(d / "c.cfg"), str(path), str(d / "ck.pth"), "sd")


def _quant(rec, layer):
    return next(e for e in rec.record if e.key == layer).value


def _producer(rec):
    return next(pr for pr in rec.prune_record if pr.producer).producer[0]


def _set_index(rec, values):
    node = _producer(rec)
    attr = next(a for a in node.attr if a.name == "prune_index")
    del attr.ints[:]
    attr.ints.extend(values)


EDITS = {
    "nan scale_d": (lambda r: setattr(_quant(r, "conv2"), "scale_d", float("nan")),
                    r"record\[\d\] \(layer 'conv2'\): scale_d is nan; it must be a finite number > 0"),
    "inf scale_d": (lambda r: setattr(_quant(r, "conv2"), "scale_d", float("inf")), r"scale_d is inf"),
    "zero scale_d": (lambda r: setattr(_quant(r, "fc"), "scale_d", 0.0), r"\(layer 'fc'\): scale_d is 0.0"),
    "negative scale_w": (lambda r: _quant(r, "conv2").scale_w.__setitem__(1, -0.5),
                         r"\(layer 'conv2'\): scale_w\[1\] is -0.5; it must be a finite number > 0"),
    "offset_d 300": (lambda r: setattr(_quant(r, "conv1"), "offset_d", 300),
                     r"\(layer 'conv1'\): offset_d is 300; it must be an INT8 value in -128..127"),
    "duplicate key": (lambda r: r.record.add(key="conv2").value.CopyFrom(_quant(r, "conv2")),
                      r"record\[3\] \(layer 'conv2'\) repeats the layer of record\[\d\]: one entry per layer"),
    "prune_index out of range": (lambda r: _set_index(r, [0, 1, 2, 3, 4, 5, 6, 99]),
                                 r"prune_record\[0\]: prune_index of 'conv1' must be distinct channels in 0..15"),
    "prune_index repeated": (lambda r: _set_index(r, [0, 1, 2, 3, 4, 5, 6, 6]),
                             r"prune_index of 'conv1' must be distinct channels"),
    "prune_index all": (lambda r: _set_index(r, list(range(16))), r"prune_index of 'conv1' removes all its 16 channels"),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_bad_record_values_are_refused_naming_file_layer_and_field(trained, case):
    d, record = trained
    rec = type(record)()
    rec.CopyFrom(record)
    edit, msg = EDITS[case]
    edit(rec)
    with pytest.raises(ValueError, match=r"record_file '.*bad.txt'.*" + msg):
        _restore(d, rec)


def test_the_unedited_record_restores(trained):
    d, record = trained
    restored = _restore(d, record)
    saved = torch.load(d / "ck.pth")["sd"]
    assert set(restored.state_dict()) == set(saved)
    for key, value in restored.state_dict().items():
        assert torch.equal(value, saved[key]), key
    # the record's clips are the trained ones: a further training batch does not re-initialise them
    clips = {k: v.clone() for k, v in restored.state_dict().items() if k.endswith(("clip_max", "clip_min"))}
    assert clips and all(bool(v) for k, v in restored.state_dict().items() if k.endswith("act_quant.initialized"))
    restored.train()
    with torch.no_grad():
        restored(torch.randn(2, 4, 6, 6) * 10)
    for key, value in clips.items():
        assert torch.equal(restored.state_dict()[key], value), key


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_an_empty_record_is_blamed_on_the_record_not_the_checkpoint(trained, text):
    d, _ = trained
    with pytest.raises(ValueError, match=r"record_file '.*bad.txt' is empty \(\d bytes\): it was not written by create_"):
        _restore(d, text)
