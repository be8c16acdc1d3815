"""Property-based fuzzing of the record file reader and of what restore builds from a record:
2:4 masks (``masks_in_record``), filter-prune groups (``groups_from_records``) and,
for fewer cases, the whole ``restore_compressed_retrain_model``. Generated and mutated records
(upstream's four and one of ours) must be accepted or refused with ValueError/TypeError and a
message; never another exception, never a hang. An accepted record must round-trip, and a
restore that succeeds must give the checkpointed model's outputs.
"""

from __future__ import annotations

import glob
import os
import random

import pytest
import torch
from google.protobuf import text_format
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.control import current_build_context
from torch import nn

import openamct as amct
from openamct.record.file_io import read_record, record_to_text
from openamct.record.scale_offset_record_pb2 import AttrType, ScaleOffsetRecord
from openamct.sparsity.filter_record import groups_from_records
from openamct.techniques.sparsity24 import masks_in_record
from tests.conftest import COMPAT
from tests.hang import no_hang
from tests.record_models import EltwiseConv, NetTrainBranch, SingleConv, SplitConcatConv
from tests.training import sgd_steps

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")]

FUZZ = settings(derandomize=True, deadline=2000, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _event(what: str) -> None:
    try:
        current_build_context()
    except Exception:
        return
    event(what)


# -- the models the records describe -----------------------------------------------------------

class SmallNet(nn.Module):
    """Ours: filter pruning on conv1, 2:4 on conv2 and fc, INT8 everywhere."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 12)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv2(self.conv1(x)))), 1))


SMALL_CFG = """retrain_data_quant_config { ulq_quantize { } }
retrain_weight_quant_config { arq_retrain { } }
prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 2 } } }
override_layer_configs { layer_name: "conv1.0" prune_config { filter_pruner {
  balanced_l2_norm_filter_prune { prune_ratio: 0.5 ascend_optimized: false } } } }
"""
X = torch.randn(8, 4, 8, 8, generator=torch.Generator().manual_seed(1))

UPSTREAM = {name: (open(os.path.join(COMPAT, "records", f"record_{name}.txt")).read(), cls)
            for name, cls in [("SingleConv", SingleConv), ("EltwiseConv", EltwiseConv),
                              ("NetTrainBranch", NetTrainBranch), ("SplitConcatConv", SplitConcatConv)]}


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """One trained SmallNet: its config, record text, checkpoint and reference eval output."""
    d = tmp_path_factory.mktemp("fuzzrec")
    cfg, rec, ck = str(d / "c.cfg"), str(d / "rec.txt"), str(d / "ck.pth")
    with open(cfg, "w") as f:
        f.write(SMALL_CFG)
    torch.manual_seed(0)
    model = amct.create_compressed_retrain_model(SmallNet(), X, cfg, rec)
    sgd_steps(model, X, steps=3, lr=0.05)
    model.eval()
    with torch.no_grad():
        y = model(X)
    torch.save({"state_dict": model.state_dict()}, ck)
    text = open(rec).read()
    record = read_record(rec)
    assert len(record.record) == 3 and len(masks_in_record(record)) == 2  # quant, 2:4 ...
    assert any(pr.producer for pr in record.prune_record)  # ... and a filter-prune group
    return {"dir": d, "cfg": cfg, "text": text, "ck": ck, "y": y}


@pytest.fixture(scope="module")
def models():
    return {name: cls() for name, (_, cls) in UPSTREAM.items()} | {"SmallNet": SmallNet()}


# -- the property --------------------------------------------------------------------------------

def check_record_text(text: str, model: nn.Module, path: str) -> str:
    """read_record + masks + filter groups; returns how far it got. Only ValueError/TypeError
    with a message may escape, accepted records must round-trip, accepted groups be sane."""
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    with no_hang():
        try:
            record = read_record(path)
        except (ValueError, TypeError) as exc:
            assert str(exc).strip()
            return "unreadable"
        again = ScaleOffsetRecord()
        text_format.Merge(record_to_text(record), again)  # what write_record writes reads back
        assert record_to_text(again) == record_to_text(record)
        try:
            masks = masks_in_record(record)
        except (ValueError, TypeError) as exc:
            assert str(exc).strip()
            return "bad mask"
        for mask in masks.values():
            assert bool(((mask == 0) | (mask == 1)).all())
        try:
            groups = groups_from_records(record, model)
        except (ValueError, TypeError) as exc:
            assert str(exc).strip()
            return "bad groups"
    for g in groups:
        assert g.removed == sorted(set(g.removed)) and all(0 <= c < g.channels for c in g.removed)
        assert all(p.end == g.channels for p in g.producers)
    return "accepted"


RECORD_TOKENS = ["{", "}", ":", "\"", "\\", "\n", "#", "nan", "inf", "-inf", "1e400", "-1", "0",
                 "9223372036854775807", "9223372036854775808", "-9223372036854775809", "99999999999999999999",
                 "INT", "INTS", "STRING", "FLOAT", "7", "prune_record", "producer", "consumer",
                 "selective_prune", "attr", "name", "ints", "i", "s", "\"conv2\"", "\"layer1.0\"",
                 "\"\u2603\"", "\"a\\\"b\"", "\"\\377\\376\"", "\x00", "\ufeff", "record", "key", "value",
                 "scale_d: nan", "offset_d: 99999999999", "__import__('os').system('touch pwned')"]
NUMBERS = ["0", "1", "-1", "2", "3", "16", "160", "999999", "9223372036854775807", "-9223372036854775808",
           "9223372036854775808", "nan", "inf", "-inf", "1e400", "1.5", "0x10", "-0"]


@st.composite
def mutated_record(draw, texts, ops=tuple(range(10))):
    text = draw(st.sampled_from(texts))
    for _ in range(draw(st.integers(1, 3))):
        n = len(text)
        op = draw(st.sampled_from(ops))
        i = draw(st.integers(0, n))
        j = draw(st.integers(i, min(n, i + 120)))
        if op == 0:  # truncated file (a crash mid-write, were writes not atomic)
            text = text[:i]
        elif op == 1:
            text = text[:i] + text[j:]
        elif op == 2:
            text = text[:i] + " " + draw(st.sampled_from(RECORD_TOKENS)) + " " + text[i:]
        elif op == 3:  # duplicated span: duplicate layers, attrs, producers
            text = text[:j] + text[i:j] + text[j:]
        elif op in (4, 5, 8):  # a number replaced: out-of-range index, huge, NaN, inf
            starts = [k for k, c in enumerate(text) if (c.isdigit() or c == "-") and k and text[k - 1] == " "]
            if starts:
                k = draw(st.sampled_from(starts))
                e = k + 1
                while e < n and (text[e].isalnum() or text[e] in ".-+"):
                    e += 1
                text = text[:k] + draw(st.sampled_from(NUMBERS)) + text[e:]
        elif op in (6, 9):  # a name replaced by an odd one
            quotes = [k for k, c in enumerate(text) if c == '"']
            if len(quotes) >= 2:
                a = draw(st.sampled_from(quotes[:-1]))
                b = text.find('"', a + 1)
                text = text[:a] + draw(st.sampled_from(['"conv2"', '"fc"', '"conv1.1"', '"layer1.0"', '""',
                                                        '"\u2603"', '"a\\nb"', '"\\377"', '"x\'y"',
                                                        '"Conv"', '"Gemm"', '"Add"', '"Concat"'])) + text[b + 1:]
        else:
            text = text[:i] + draw(st.text(max_size=20)) + text[j:]
    return text


def test_every_upstream_record_is_a_fuzz_seed():
    assert len(UPSTREAM) == len(glob.glob(os.path.join(COMPAT, "records", "*.txt")))


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_unmutated_upstream_records_are_accepted(name, models, tmp_path):
    assert check_record_text(UPSTREAM[name][0], models[name], str(tmp_path / "r.txt")) == "accepted"


def test_our_record_is_accepted(ours, models, tmp_path):
    assert check_record_text(ours["text"], models["SmallNet"], str(tmp_path / "r.txt")) == "accepted"


@given(data=st.data(), name=st.sampled_from(sorted(UPSTREAM)))
@settings(FUZZ, max_examples=900)
def test_mutated_upstream_records(ours, models, data, name):
    text = data.draw(mutated_record([UPSTREAM[name][0]]))
    _event(f"{name}: " + check_record_text(text, models[name], str(ours["dir"] / "u.txt")))


@given(data=st.data())
@settings(FUZZ, max_examples=900)
def test_mutated_own_records(ours, models, data):
    text = data.draw(mutated_record([ours["text"]]))
    _event(check_record_text(text, models["SmallNet"], str(ours["dir"] / "m.txt")))


@given(data=st.data(), name=st.sampled_from(sorted(UPSTREAM) + ["SmallNet"]))
@settings(FUZZ, max_examples=600)
def test_record_files_with_any_bytes(ours, models, data, name):
    """Other encodings, BOMs, binary splices, a multibyte character cut by truncation."""
    text = ours["text"] if name == "SmallNet" else UPSTREAM[name][0]
    text = text.replace('name: "', 'name: "\u00e4\u2603', data.draw(st.integers(0, 2)))
    raw = text.encode(data.draw(st.sampled_from(["utf-8", "utf-16", "utf-32", "latin-1", "gb18030"])),
                      errors="replace")
    op = data.draw(st.integers(0, 3))
    if op == 0:
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    elif op == 1:
        raw = b"\xef\xbb\xbf" + raw
    elif op == 2:
        i = data.draw(st.integers(0, len(raw)))
        raw = raw[:i] + data.draw(st.binary(min_size=1, max_size=32)) + raw[i:]
    path = ours["dir"] / "b.txt"
    path.write_bytes(raw)
    with no_hang():
        try:
            record = read_record(str(path))
        except (ValueError, TypeError) as exc:
            assert str(exc).strip()
            _event("refused")
            return
        try:
            masks_in_record(record)
            groups_from_records(record, models[name])
        except (ValueError, TypeError) as exc:
            assert str(exc).strip()
    _event("read")


# -- generated records (a grammar of the real message, hostile values) ---------------------------

LAYERS = {"SmallNet": ["conv1.0", "conv1.1", "conv2", "fc"],
          "EltwiseConv": ["layer1.0", "layer1.1", "layer2.0", "layer5.0", "layer6.0"],
          "SplitConcatConv": ["layer1.0", "layer2_1.0", "layer2_1.1", "layer2_2.0", "layer3.0"]}
ODD = ["", "\u2603", "a\"b", "x" * 500, "conv1", "pool", "add_0", "layer1.0\n"]
KINDS = ["Conv", "Gemm", "BatchNormalization", "ConvTranspose", "Add", "Concat", "Relu", "", "conv"]
ATTRS = ["type", "begin", "end", "prune_axis", "group", "prune_group", "prune_index", "mask_shape",
         "selective_mask", "bogus"]


def gen_record(seed: int, model_name: str) -> ScaleOffsetRecord:
    r = random.Random(seed)
    names = LAYERS[model_name]
    p_odd = r.choice([0.0, 0.1, 0.3])

    def name():
        return r.choice(ODD) if r.random() < p_odd else r.choice(names)

    def num(good, bits=64):
        odd = [-1, 0, 2**31 - 1, -2**31, 10**6] + ([2**31, 2**63 - 1, -2**63] if bits == 64 else [])
        return r.choice(odd) if r.random() < p_odd else good

    def node(n, for_mask=False):
        n.name = name()
        if for_mask:
            shape = [num(r.choice([16, 12, 8, 4])) for _ in range(r.choice([1, 2, 2, 4, 4, 70]))]
            words = [num(r.randint(-2**63, 2**63 - 1)) for _ in range(r.choice([0, 1, 4, 36, 100]))]
            specs = [("mask_shape", shape), ("selective_mask", words)]
        else:
            specs = [("type", r.choice(KINDS)), ("begin", num(0)), ("end", num(r.choice([16, 8, 160]))),
                     ("prune_axis", num(r.choice([1, -1]))), ("group", num(r.choice([1, 2]))),
                     ("prune_group", num(r.choice([1, 2]))),
                     ("prune_index", [num(r.randint(0, 16)) for _ in range(r.randint(0, 10))])]
        for key, value in specs:
            if r.random() < 0.1:
                continue
            if r.random() < p_odd:  # wrong attribute type, or an unknown attribute
                key = r.choice(ATTRS) if r.random() < 0.3 else key
                a = n.attr.add(name=key, type=r.choice([0, 1, 2, 3, 4, 5, 6]))
                a.f = float(r.choice(["nan", "inf", "1.5"]))
                continue
            if isinstance(value, str):
                n.attr.add(name=key, type=AttrType.STRING, s=value.encode())
            elif isinstance(value, list):
                n.attr.add(name=key, type=AttrType.INTS, ints=value)
            else:
                n.attr.add(name=key, type=AttrType.INT, i=value)

    rec = ScaleOffsetRecord()
    for _ in range(r.randint(0, 3)):
        e = rec.record.add(key=name())
        e.value.scale_d = r.choice([0.01, float("nan"), float("inf"), -1.0, 0.0, 3.4e38])
        e.value.offset_d = num(-128, bits=32)
        e.value.scale_w.extend([r.choice([0.001, float("nan"), -0.0]) for _ in range(r.randint(0, 4))])
    for _ in range(r.randint(0, 3)):
        pr = rec.prune_record.add()
        if r.random() < 0.4:
            node(pr.selective_prune, for_mask=True)
        else:
            for _ in range(r.randint(0, 3)):
                node(pr.producer.add())
            for _ in range(r.randint(0, 3)):
                node(pr.consumer.add())
    return rec


@given(seed=st.integers(0, 2**63), model_name=st.sampled_from(sorted(LAYERS)))
@settings(FUZZ, max_examples=900)
def test_generated_records(ours, models, seed, model_name):
    text = record_to_text(gen_record(seed, model_name))
    note(text[:3000])
    model = models[model_name]
    _event(check_record_text(text, model, str(ours["dir"] / "g.txt")))


# -- the whole restore path, fewer cases --------------------------------------------------------

@given(data=st.data())
@settings(FUZZ, max_examples=100, deadline=10000)
def test_restore_from_mutated_records(ours, data):
    """Restore either refuses the record clearly or rebuilds the model that the checkpoint fits:
    then its outputs are the checkpointed model's. Mostly value-level mutations (numbers, names,
    duplicated spans), so that many records still parse and reach the replay."""
    text = data.draw(mutated_record([ours["text"]], ops=(0, 3, 4, 5, 6, 8, 9)))
    note(text)
    rec = ours["dir"] / "restore.txt"
    rec.write_text(text, encoding="utf-8", errors="surrogatepass")
    with no_hang(60):
        try:
            model = amct.restore_compressed_retrain_model(SmallNet(), X, ours["cfg"], str(rec), ours["ck"], "state_dict")
        except (ValueError, TypeError) as exc:
            assert str(exc).strip()
            _event("refused")
            return
    _event("restored")
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(X), ours["y"])


def test_record_with_quant_entry_for_unknown_layer_is_refused(ours, tmp_path):
    rec = tmp_path / "other.txt"
    rec.write_text(ours["text"].replace('key: "fc"', 'key: "no_such_layer"'))
    with pytest.raises(ValueError, match="no_such_layer"):
        amct.restore_compressed_retrain_model(SmallNet(), X, ours["cfg"], str(rec), ours["ck"], "state_dict")
