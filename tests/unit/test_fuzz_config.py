"""Property-based fuzzing of the config parser, the field validation and the per-layer plan
resolver: generated and mutated upstream configs must be accepted (and then give a
plan that obeys the rules) or raise ValueError/TypeError with a message; nothing else, no hang.

The model graph is captured once per module; each example only parses and plans, so thousands
of cases fit in a few seconds. ``derandomize=True`` makes CI runs reproducible.
"""

from __future__ import annotations

import glob
import json
import math
import os
import random

import pytest
import torch
from google.protobuf import text_encoding
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.control import current_build_context

from openamct import pipeline
from openamct.config.parse import parse_config_text
from openamct.config.source import build_plan, load_plan
from openamct.graph.capture import capture_graph
from openamct.graph.layers import find_layers
from openamct.techniques import TECHNIQUES
from openamct.techniques.filter_prune import FilterPruning
from openamct.techniques.quantization import Quantization
from openamct.techniques.sparsity24 import Sparsity24
from tests.conftest import COMPAT
from tests.hang import no_hang
from tests.models import Net001

CONFIGS = sorted(glob.glob(os.path.join(COMPAT, "configs", "*.cfg")))
TEXTS = [open(p, encoding="utf-8").read() for p in CONFIGS]
APIS = ("prune", "compressed", "quant")
QUANT_TYPES, FILTER_TYPES, NM_TYPES = Quantization.layer_types, FilterPruning.layer_types, Sparsity24.layer_types
HANG_S = 10.0  # one example taking this long is a hang, not a slow case
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")]

FUZZ = settings(derandomize=True, deadline=2000, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])




@pytest.fixture(scope="module")
def net():
    """(layers, modules) of Net001, captured once for every example of the module."""
    model = Net001().eval()
    graph = capture_graph(model, torch.randn(1, 2, 28, 28))
    return find_layers(model, graph), {n: type(m).__name__ for n, m in model.named_modules()}


# -- the properties ----------------------------------------------------------------------------

def check_plan(plan, layers, api: str) -> None:
    """What every accepted plan must satisfy, whatever config produced it."""
    assert set(plan.layers) == set(layers)
    assert plan.batch_num >= 1
    assert not plan.is_empty()
    for name, lp in plan.layers.items():
        info = layers[name]
        if info.excluded:
            assert lp.quant is None and lp.prune is None, name
        if lp.quant is not None:
            assert api != "prune" and info.type in QUANT_TYPES, name
            a = lp.quant.act
            assert (a.clip_max is None) == (a.clip_min is None), name
            if a.clip_max is not None:
                assert math.isfinite(a.clip_max) and math.isfinite(a.clip_min), name
                assert a.clip_max > 0 > a.clip_min, name
            assert lp.quant.wts.algo in ("arq", "ulq") and lp.quant.wts.dst_type in ("INT8", "INT4")
            assert a.dst_type == "INT8", name  # INT4 is a weight-only format
        if lp.filter is not None:
            assert api != "quant" and info.type in FILTER_TYPES and not info.depthwise, name
            assert 0.0 < lp.filter.ratio < 1.0, name
        if lp.nm is not None:
            assert api != "quant" and info.type in NM_TYPES and info.cin_per_group > 2, name
            assert lp.nm.update_freq >= 0 and (lp.nm.n, lp.nm.m) == (2, 4)


def _event(what: str) -> None:
    try:
        current_build_context()
    except Exception:  # called outside a hypothesis test
        return
    event(what)


def accept_or_reject(text: str, net, api: str) -> bool:
    """Parse + plan; True if accepted. Only ValueError/TypeError with a message may escape."""
    layers, modules = net
    with no_hang():
        try:
            cfg = parse_config_text(text, "fuzz.cfg")
            plan = build_plan(cfg, layers, api, techniques=TECHNIQUES, modules=modules, text=text, src="fuzz.cfg")
        except (ValueError, TypeError) as exc:
            assert str(exc).strip(), f"{type(exc).__name__} without a message"
            _event(f"{api}: rejected")
            return False
    check_plan(plan, layers, api)
    _event(f"{api}: accepted")
    return True


# -- generated configs (a grammar of the real fields, filled with hostile values) ---------------
# Built with a seeded random.Random from one drawn integer: generating a config field by field
# through hypothesis draws costs ~10 ms a case, this costs ~0.1 ms. Failures print the text.

NAMES = ["layer1.0", "layer2.0", "layer3.0", "layer4.0", "layer5.0", "layer6.0", "fc.0", "fc.2", "fc.5"]
ODD_NAMES = ["", " ", "layer1.0 ", "LAYER1.0", "layer1.0\n", "layer1", "fc", "fc.1", "avg_pool", "layer1.1",
             "\u2603", "\u5c421.0", "a\"b", "a'b", "\\", "\x00", "layer1.0\x00", "\u202elayer1.0",
             "\U0001f600" * 20, "x" * 3000, "layer2.0\r\n", "layer2.0\"; import os #", "${HOME}", "%s%n"]
TYPES = ["Conv2d", "Linear", "ConvTranspose2d", "Conv1d", "Conv3d", "ConvTranspose1d"]
ODD_TYPES = ["conv", "Conv2D", "BatchNorm2d", "ReLU", "", "Linear\n", "Sequential", "Net001", "\u2603",
             "nn.Conv2d", " Conv2d"]
FLOATS = ["1", "6.0", "-6.0", "0.3", "0.5", "-2.5", "0.999999", "12"]
ODD_FLOATS = ["0", "-0", "1e-45", "-1e-45", "3.4e38", "-3.4e38", "3.5e38", "1e400", "-1e400", "nan", "-nan",
              "inf", "-inf", "infinity", "-Infinity", "0x10", "1e", "--1", "1.0f", "99999999999999999999999999999",
              ".5", "5.", "1_0", "\"6\"", "1", "0.0000001", "-0.0000001"]
INTS = ["0", "1", "2", "3", "10"]
ODD_INTS = ["-1", "4294967295", "4294967296", "18446744073709551616", "0x7fffffff", "1.5", "nan", "07", "1e3",
            "99999999999999999999999999999999999999", "0xffffffffffffffffff", "0"]
BOOLS = ["true", "false", "True", "False", "1", "0"]
ODD_BOOLS = ["t", "f", "yes", "2", "\"true\"", "-1", "TRUE"]
DTYPES = ["INT8", "1"]
ODD_DTYPES = ["INT4", "INT16", "0", "2", "3", "-1", "FLOAT", "int8"]


def q(s: str) -> str:
    return '"' + text_encoding.CEscape(s, as_utf8=True) + '"'


class Gen:
    """Random config text: mostly well-formed, each value hostile with probability ``p_odd``."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.p_odd = self.r.choice([0.0, 0.05, 0.15, 0.4])

    def pick(self, good, odd):
        return self.r.choice(odd if self.r.random() < self.p_odd else good)

    def maybe(self, text: str, p: float = 0.7) -> str:
        return text if self.r.random() < p else ""

    def string(self, good, odd) -> str:
        s = self.pick(good, odd)
        style = self.r.random()
        if style < self.p_odd / 3:  # raw, unescaped: may break the quoting on purpose
            return '"' + s + '"'
        if style < self.p_odd / 2:
            return "'" + text_encoding.CEscape(s, as_utf8=False) + "'"
        return q(s)

    def data_quant(self) -> str:
        parts = []
        if self.r.random() < 0.6:
            clips = [self.maybe(f"clip_max: {self.pick(FLOATS, ODD_FLOATS)}", 0.9),
                     self.maybe(f"clip_min: {self.pick(FLOATS, ODD_FLOATS)}", 0.9)]
            parts.append("clip_max_min { " + " ".join(clips) + " }")
        parts.append(self.maybe(f"fixed_min: {self.pick(BOOLS, ODD_BOOLS)}", 0.4))
        parts.append(self.maybe(f"dst_type: {self.pick(DTYPES, ODD_DTYPES)}", 0.4))
        self.r.shuffle(parts)
        return "retrain_data_quant_config { " + self.maybe("ulq_quantize { " + " ".join(parts) + " }", 0.9) + " }"

    def weight_quant(self) -> str:
        algos = self.r.sample(["arq_retrain", "ulq_retrain"], self.r.choice([0, 1, 1, 1, 1, 2]))
        inner = [f"{a} {{ {self.maybe('dst_type: ' + self.pick(DTYPES, ODD_DTYPES), 0.4)} "
                 f"{self.maybe('channel_wise: ' + self.pick(BOOLS, ODD_BOOLS), 0.5)} }}" for a in algos]
        return "retrain_weight_quant_config { " + " ".join(inner) + " }"

    def prune(self) -> str:
        if self.r.random() < 0.5:
            fields = [self.maybe(f"prune_ratio: {self.pick(FLOATS[3:5] + ['0.25', '0.75'], ODD_FLOATS)}", 0.95),
                      self.maybe(f"ascend_optimized: {self.pick(BOOLS, ODD_BOOLS)}", 0.5)]
            body = self.maybe("balanced_l2_norm_filter_prune { " + " ".join(fields) + " }", 0.95)
            return "prune_config { filter_pruner { " + body + " } }"
        fields = [self.maybe(f"n_out_of_m_type: {self.pick(['M4N2', '0'], ['1', 'M8N4', '-1'])}", 0.5),
                  self.maybe(f"update_freq: {self.pick(INTS, ODD_INTS)}", 0.5)]
        body = self.maybe("l1_selective_prune { " + " ".join(fields) + " }", 0.95)
        return "prune_config { n_out_of_m_pruner { " + body + " } }"

    def override(self, by_type: bool) -> str:
        key = ("layer_type: " + self.string(TYPES, ODD_TYPES) if by_type
               else "layer_name: " + self.string(NAMES, ODD_NAMES))
        parts = [self.maybe(key, 0.95)] + [self.r.choice((self.data_quant, self.weight_quant, self.prune))()
                                           for _ in range(self.r.randint(0, 3))]
        return ("override_layer_types" if by_type else "override_layer_configs") + " { " + " ".join(parts) + " }"

    def item(self) -> str:
        k = self.r.randint(0, 9)
        if k <= 2:
            return (self.data_quant, self.weight_quant, self.prune)[k]()
        if k == 3:
            return f"batch_num: {self.pick(INTS[1:], ODD_INTS)}"
        if k == 4:
            field = self.r.choice(["skip_layers", "quant_skip_layers", "regular_prune_skip_layers"])
            return f"{field}: {self.string(NAMES, ODD_NAMES)}"
        if k == 5:
            field = self.r.choice(["skip_layer_types", "quant_skip_types", "regular_prune_skip_types"])
            return f"{field}: {self.string(TYPES, ODD_TYPES)}"
        if k in (6, 7):
            return self.override(False)
        if k == 8:
            return self.override(True)
        return f"fakequant_precision_mode: {self.pick(['FORCE_FP16_QUANT', '1'], ['0', '7', 'FP16'])}"

    def config(self) -> str:
        items = [self.item() for _ in range(self.r.randint(0, 7))]
        sep = self.r.choice([" ", "\n", "\n\n  ", " # a comment\n", "\r\n", "\t", ";", ","])
        text = sep.join(items)
        if self.r.random() < 0.25:  # the upstream "field : { ... }" spelling
            text = text.replace(" {", " : {")
        return text


config_text = st.builds(lambda seed: Gen(seed).config(), st.integers(0, 2**63))


@given(text=config_text, api=st.sampled_from(APIS))
@settings(FUZZ, max_examples=1500)
def test_generated_configs(net, text, api):
    note(repr(text))
    accept_or_reject(text, net, api)


# -- mutated upstream configs ----------------------------------------------------------------

TOKENS = ["{", "}", ":", "\"", "'", "\\", "\n", "#", "nan", "inf", "-inf", "1e400", "-1", "0",
          "99999999999999999999999", "layer1.0", "\"layer1.0\"", "\"\u2603\"", "Conv2d", "true",
          "prune_config", "retrain_data_quant_config", "override_layer_configs", "layer_name",
          "clip_max", "clip_min", "prune_ratio", "update_freq", "batch_num", "[x.y]", "<", ">",
          "__import__('os').system('touch pwned')", "\x00", "\ufeff", "\u00e9", "\U0001f600", "\t"]
NUMBER_SWAPS = FLOATS + ODD_FLOATS + ODD_INTS


@st.composite
def mutated(draw, texts):
    text = draw(st.sampled_from(texts))
    for _ in range(draw(st.integers(1, 3))):
        n = len(text)
        op = draw(st.integers(0, 7))
        i = draw(st.integers(0, n))
        j = draw(st.integers(i, min(n, i + 80)))
        if op == 0:  # truncated file
            text = text[:i]
        elif op == 1:  # a span deleted
            text = text[:i] + text[j:]
        elif op == 2:  # a hostile token inserted
            text = text[:i] + draw(st.sampled_from(TOKENS)) + text[i:]
        elif op == 3:  # a span duplicated (duplicate layers, fields, braces)
            text = text[:j] + text[i:j] + text[j:]
        elif op == 4:  # a number replaced by a huge/NaN/inf/bad one
            nums = [k for k, c in enumerate(text) if c.isdigit() and (k == 0 or not text[k - 1].isalnum())]
            if nums:
                k = draw(st.sampled_from(nums))
                e = k
                while e < n and (text[e].isalnum() or text[e] in ".-+"):
                    e += 1
                text = text[:k] + draw(st.sampled_from(NUMBER_SWAPS)) + text[e:]
        elif op == 5:  # a quoted string replaced by an odd name
            quotes = [k for k, c in enumerate(text) if c == '"']
            if len(quotes) >= 2:
                a = draw(st.sampled_from(quotes[:-1]))
                b = text.find('"', a + 1)
                name = draw(st.sampled_from(NAMES + ODD_NAMES + TYPES + ODD_TYPES))
                lit = q(name) if draw(st.booleans()) else '"' + name + '"'
                text = text[:a] + lit + text[b + 1:]
        elif op == 6:  # lines swapped
            lines = text.split("\n")
            if len(lines) > 1:
                a, b = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
                lines[a], lines[b] = lines[b], lines[a]
                text = "\n".join(lines)
        else:  # random unicode text spliced in
            text = text[:i] + draw(st.text(max_size=20)) + text[j:]
    return text


@given(text=mutated(TEXTS), api=st.sampled_from(APIS))
@settings(FUZZ, max_examples=2500)
def test_mutated_upstream_configs(net, text, api):
    accept_or_reject(text, net, api)


def test_unmutated_upstream_configs_reach_both_outcomes(net):
    """The seeds of the mutation fuzz: several are accepted, several rejected (so the fuzz
    starts from both sides of the validator, not only from garbage)."""
    outcomes = [accept_or_reject(t, net, api) for t in TEXTS for api in ("prune", "compressed")]
    assert sum(outcomes) >= 8 and outcomes.count(False) >= 8


# -- raw bytes through the file loader (encodings, BOMs, truncated multibyte) -------------------

ENCODINGS = ["utf-8", "utf-16", "utf-16-le", "latin-1", "cp1252", "gb18030", "utf-32"]


@st.composite
def config_bytes(draw):
    text = draw(st.sampled_from(TEXTS) | config_text)
    if draw(st.booleans()):
        text = text.replace('"layer2.0"', '"l\u00e4yer2.0\u2603"')
    data = text.encode(draw(st.sampled_from(ENCODINGS)), errors="replace")
    op = draw(st.integers(0, 4))
    if op == 0:
        data = data[:draw(st.integers(0, len(data)))]  # may cut a multibyte sequence
    elif op == 1:
        data = b"\xef\xbb\xbf" + data  # UTF-8 BOM
    elif op == 2:
        k = draw(st.integers(0, len(data)))
        data = data[:k] + draw(st.binary(min_size=1, max_size=16)) + data[k:]
    elif op == 3:
        data = draw(st.binary(max_size=200))
    return data


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzzcfg")


@given(data=config_bytes(), api=st.sampled_from(APIS))
@settings(FUZZ, max_examples=600)
def test_config_files_with_any_bytes(net, workdir, data, api):
    layers, modules = net
    path = workdir / "c.cfg"
    path.write_bytes(data)
    with no_hang():
        try:
            plan = load_plan(str(path), layers, api, modules, "config_defination", techniques=TECHNIQUES)
        except (ValueError, TypeError) as exc:
            assert str(exc).strip()
            event("rejected")
            return
    check_plan(plan, layers, api)
    event("accepted")


# -- the QAT family's JSON config --------------------------------------------------------------

ODD_JSON = [None, True, False, 0, 1, -1, 1.5, "1", "", [], {}, float("nan"), float("inf"), float("-inf"),
            1e308, 2**70, -2**70, "INT4", "INT16", "\u2603", [[[1]]], {"a": {"b": None}}, "ulq_retrain"]


def gen_quant_json(seed: int) -> str:
    """An upstream-shaped QAT JSON config; each value hostile with a random probability."""
    r = random.Random(seed)
    p_odd = r.choice([0.0, 0.05, 0.2, 0.5])

    def v(good):
        return r.choice(ODD_JSON) if r.random() < p_odd else good

    doc = {"version": v(1), "batch_num": v(r.choice([1, 2, 3]))}
    names = r.sample(NAMES, r.randint(0, len(NAMES))) + r.sample(ODD_NAMES, r.choice([0, 0, 0, 1, 2]))
    for name in names:
        cmax = r.choice([6.0, 1.0, 0.5, 100.0])
        d = {"algo": v("ulq_quantize"), "dst_type": v("INT8")}
        if r.random() < 0.5:
            d.update(clip_max=v(cmax), clip_min=v(-cmax))
        if r.random() < 0.3:
            d["fixed_min"] = v(r.random() < 0.5)
        w = {"algo": v(r.choice(["arq_retrain", "ulq_retrain"])), "channel_wise": v(r.random() < 0.5),
             "dst_type": v("INT8")}
        entry = {"retrain_enable": v(r.random() < 0.8), "retrain_data_config": v(d), "retrain_weight_config": v(w)}
        for key in r.sample(sorted(entry), r.choice([0, 0, 0, 1])):
            del entry[key]
        doc[name] = v(entry)
    text = json.dumps(doc, allow_nan=True)
    op = r.randint(0, 9)
    if op == 0:
        text = text[:r.randint(1, len(text))]
    elif op == 1:
        text = '{"a": ' + "[" * r.choice([10, 5000, 200000]) + "]"  # deep nesting
    elif op == 2:
        text = text.replace("1", "1" + "0" * r.choice([10, 400, 5000]), 1)  # huge numbers
    elif op == 3:
        text = text.replace("{", "{" + json.dumps(r.choice(NAMES)) + ": {}, ", 1)  # duplicate keys
    return text


quant_json = st.builds(gen_quant_json, st.integers(0, 2**63))


@given(text=quant_json)
@settings(FUZZ, max_examples=600)
def test_quant_json_configs(net, workdir, text):
    note(text[:2000])
    layers, modules = net
    path = workdir / "c.json"
    path.write_text(text, encoding="utf-8")
    with no_hang():
        try:
            plan = load_plan(str(path), layers, "quant", modules, "config_file", techniques=TECHNIQUES)
        except (ValueError, TypeError) as exc:
            assert str(exc).strip()
            event("rejected")
            return
    assert type(plan.batch_num) is int and plan.batch_num >= 1 and not plan.is_empty()
    for name, lp in plan.layers.items():
        if lp.quant is not None:
            assert layers[name].type in QUANT_TYPES and not layers[name].excluded
            a = lp.quant.act
            if a.clip_max is not None:
                assert math.isfinite(a.clip_max) and a.clip_max > 0 > a.clip_min
    event("accepted")


# -- the whole front half of the pipeline (capture + load + plan), fewer cases ------------------

@given(text=mutated(TEXTS), api=st.sampled_from(APIS))
@settings(FUZZ, max_examples=20, deadline=5000)
def test_analyse_end_to_end(workdir, text, api):
    path = workdir / "a.cfg"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    with no_hang(30):
        try:
            a = pipeline.analyse(Net001().eval(), torch.randn(1, 2, 28, 28), str(path), api)
        except (ValueError, TypeError) as exc:
            assert str(exc).strip()
            return
    check_plan(a.plan, a.layers, api)
