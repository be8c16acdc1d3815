"""Fuzzing the *values* that enter from files (test_fuzz_config.py and test_fuzz_record.py
cover their syntax): checkpoint contents (dtypes, NaN/inf, mask values, clips) and record
values (NaN, inf, ranges of scales, offsets and prune indices). Every mutation is either refused
with a ValueError naming the file and the key/field, or accepted with values that are in range."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import openamct as amct
from openamct.record.file_io import read_record, record_to_text
from tests.hang import no_hang
from tests.trained_record import Net, X, compress_and_train

pytestmark = pytest.mark.slow

FUZZ = settings(derandomize=True, deadline=5000, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("fv")
    sd = compress_and_train(d)
    return d, sd, read_record(str(d / "rec.txt"))


SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 0.5, 1.0, 2.0, 1e30, -1e-30]


def _restore(d, rec_path, pth):
    with no_hang():
        return amct.restore_compressed_retrain_model(Net(), X, str(d / "c.cfg"), str(rec_path), str(pth), "sd")


@given(data=st.data())
@settings(FUZZ, max_examples=400)
def test_checkpoint_values(base, data):
    d, sd, _ = base
    key = data.draw(st.sampled_from(sorted(sd)))
    t = sd[key].clone()
    op = data.draw(st.sampled_from(["dtype", "special", "fill"]))
    if op == "dtype":
        t = t.to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.float16, torch.float64, torch.bool,
                                            torch.uint8])))
    elif t.is_floating_point() and t.numel():
        flat = t.reshape(-1)
        for _ in range(data.draw(st.integers(1, 3))):
            i = data.draw(st.integers(0, flat.numel() - 1))
            flat[i] = data.draw(st.sampled_from(SPECIAL)) if op == "special" else data.draw(
                st.floats(-4, 4, allow_nan=False, allow_subnormal=False))
        t = flat.reshape(sd[key].shape)
    bad = dict(sd, **{key: t})
    pth = d / "fuzz.pth"
    torch.save({"sd": bad}, pth)
    try:
        m = _restore(d, d / "rec.txt", pth)
    except ValueError as exc:
        assert "pth_file" in str(exc) and str(exc).strip()
        return
    out = m.state_dict()
    for k, v in out.items():
        if v.is_floating_point():
            assert bool(torch.isfinite(v).all()), k
        if k.endswith(".mask"):
            assert bool(((v == 0) | (v == 1)).all()), k
    # clips: any finite pair is a state training can produce (an empty range is reported, not refused)


INTS = st.one_of(st.integers(-300, 300), st.sampled_from([-2**31, 2**31 - 1, -129, -128, 127, 128]))


@given(data=st.data())
@settings(FUZZ, max_examples=400)
def test_record_values(base, data):
    d, _, record = base
    rec = type(record)()
    rec.CopyFrom(record)
    for _ in range(data.draw(st.integers(1, 3))):
        what = data.draw(st.sampled_from(["scale_d", "offset_d", "scale_w", "prune_index", "dup"]))
        entry = rec.record[data.draw(st.integers(0, len(rec.record) - 1))]
        if what == "scale_d":
            entry.value.scale_d = data.draw(st.sampled_from(SPECIAL))
        elif what == "offset_d":
            entry.value.offset_d = data.draw(INTS)
        elif what == "scale_w" and entry.value.scale_w:
            entry.value.scale_w[data.draw(st.integers(0, len(entry.value.scale_w) - 1))] = data.draw(
                st.sampled_from(SPECIAL))
        elif what == "prune_index":
            node = next(pr for pr in rec.prune_record if pr.producer).producer[0]
            attr = next(a for a in node.attr if a.name == "prune_index")
            del attr.ints[:]
            attr.ints.extend(data.draw(st.lists(st.integers(-3, 20), max_size=17)))
        elif what == "dup":
            rec.record.add(key=entry.key).value.CopyFrom(entry.value)
    path = d / "fuzz_rec.txt"
    path.write_text(record_to_text(rec))
    try:
        _restore(d, path, d / "ck.pth")
    except ValueError as exc:
        assert str(exc).startswith("record_file") or "pth_file" in str(exc), exc
        return
    for e in read_record(str(path)).record:  # accepted: every value in range
        assert math.isfinite(e.value.scale_d) and e.value.scale_d > 0
        assert -128 <= e.value.offset_d <= 127
        assert all(math.isfinite(s) and s > 0 for s in e.value.scale_w)
