"""The QAT family's JSON config (what create_quant_retrain_config writes): the quantization
technique's config slice in the form upstream's QAT family reads (``Quantization.plan_from_json``).

Layout (upstream-like, flat): {"version": 1, "batch_num": N, "<layer>": {"retrain_enable": bool,
"retrain_data_config": {"algo": "ulq_quantize", "dst_type": "INT8", ["clip_max", "clip_min"],
["fixed_min"]}, "retrain_weight_config": {"algo": "arq_retrain"|"ulq_retrain", "channel_wise":
bool, "dst_type": "INT8"}}, ...}. Parsed with json, never evaluated. The two ``dst_type`` of a
layer name a pair of ``openamct.formats.PAIRS`` its type takes (A8W8, A8W4; A16W8 on LSTM/GRU).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence

from openamct._atomic import atomic_write_bytes
from openamct.config.errors import ConfigError
from openamct.config.rules import QUANT
from openamct.config.specs import LayerPlan, Plan
from openamct.formats import ACTIVATION_FORMATS, WEIGHT_FORMATS, format_pair
from openamct.graph.layers import LayerInfo
from openamct.techniques.quantization import ActSpec, QuantSpec, WtsSpec


def plan_to_json(plan: Plan, technique: str, types: tuple[str, ...]) -> dict:
    """The JSON of ``plan``'s ``technique`` slices (QuantSpec) for the layers of ``types``."""
    data: dict = {"version": 1, "batch_num": plan.batch_num}
    for name, lp in plan.layers.items():
        if lp.type not in types:
            continue
        spec = lp.specs.get(technique)
        entry: dict = {"retrain_enable": spec is not None}
        if spec is not None:
            entry.update(quant_entry(spec, "retrain"))
        data[name] = entry
    return data


def quant_entry(spec, family: str) -> dict:
    """A layer's ``{family}_data_config`` and ``{family}_weight_config`` JSON for its QuantSpec
    (``family``: "retrain" here, "distill" in the distillation JSON)."""
    a, w = spec.act, spec.wts
    d = {"algo": "ulq_quantize", "dst_type": a.dst_type}
    if a.clip_max is not None:
        d.update(clip_max=a.clip_max, clip_min=a.clip_min)
    if a.fixed_min is not None:
        d["fixed_min"] = a.fixed_min
    return {f"{family}_data_config": d,
            f"{family}_weight_config": {"algo": f"{w.algo}_{family}", "channel_wise": w.channel_wise,
                                        "dst_type": w.dst_type}}


def quant_slice(techniques: Sequence) -> tuple[str, tuple[str, ...]]:
    """(name, eligible layer types) of the quantization technique of a registry: the JSON config
    is that technique's slice, and the only one it has."""
    quant = next((t for t in techniques if t.family is QUANT), None)
    if quant is None:
        raise ValueError("the techniques in use have no quantization technique: a QAT JSON config needs one")
    return quant.name, tuple(quant.layer_types)


def write_quant_json(path: str, plan: Plan, techniques: Sequence) -> None:
    text = json.dumps(plan_to_json(plan, *quant_slice(techniques)), indent=2) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def _field(obj: Mapping, key: str, types, where: str, default=None, required=False):
    if key not in obj:
        if required:
            raise ConfigError(f"{where}: missing {key!r}")
        return default
    value = obj[key]
    if not isinstance(value, types) or (isinstance(value, bool) and types in ((int, float), float, int)):
        raise ConfigError(f"{where}.{key}: wrong type {type(value).__name__}")
    return value


# The keys a layer entry and its blocks may hold: anything else is a typo that would be ignored.
_ENTRY_KEYS = {"": ("retrain_enable", "retrain_data_config", "retrain_weight_config"),
               "retrain_data_config": ("algo", "dst_type", "clip_max", "clip_min", "fixed_min"),
               "retrain_weight_config": ("algo", "channel_wise", "dst_type")}


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _no_duplicates(pairs: list) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _line_of(text: str, key: str, nth: int = 1, start: int = 0) -> str:
    """'line N: ' of the nth occurrence of ``key`` as an object key at or after ``start``."""
    pattern = re.compile(r'"' + re.escape(key) + r'"\s*:')
    hits = [m.start() for m in pattern.finditer(text, start)]
    if len(hits) < nth:
        return ""
    return f"line {text.count(chr(10), 0, hits[nth - 1]) + 1}: "


def _check_keys(entry: dict, name: str, text: str, src: str) -> None:
    start = max(text.find(f'"{name}"'), 0)
    for block, allowed in _ENTRY_KEYS.items():
        obj = entry.get(block) if block else entry
        if not isinstance(obj, dict):
            continue
        for key in obj:
            if key not in allowed:
                where = f"layer {name!r}" + (f".{block}" if block else "")
                raise ConfigError(f"{src}: {_line_of(text, key, start=start)}{where}: unknown key {key!r} "
                                  f"(allowed: {', '.join(allowed)})")


def plan_from_json(raw: bytes, layers: Mapping[str, LayerInfo], src: str, technique: str,
                   types: tuple[str, ...]) -> Plan:
    """The plan of a JSON config: ``technique`` (the quantization technique's name) gets a
    QuantSpec for each enabled layer of ``types`` (its eligible layer types)."""
    try:
        data = json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as dup:
        text = raw.decode("utf-8", errors="replace")
        raise ConfigError(f"{src}: {_line_of(text, dup.key, nth=2)}key {dup.key!r} is given twice: "
                          "JSON would keep only the last one; give it once") from None
    except (ValueError, RecursionError) as exc:  # also too deep nesting, too many digits, bad UTF-8
        raise ConfigError(f"{src}: not valid JSON: {exc}") from None
    text = raw.decode("utf-8", errors="replace")
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: the top level must be a JSON object")
    batch_num = _field(data, "batch_num", int, src, default=1)
    if batch_num < 1:
        raise ConfigError(f"{src}: batch_num must be >= 1, got {batch_num}")
    plan_layers = {n: LayerPlan(n, info.type) for n, info in layers.items()}
    for name, entry in data.items():
        if name in ("version", "batch_num"):
            continue
        where = f"{src}: layer {name!r}"
        if name not in layers:
            raise ConfigError(f"{where} does not exist in the model (or is not a supported layer)")
        if layers[name].type not in types:
            raise ConfigError(f"{where} is a {layers[name].type}, which is not quantizable")
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: must be an object")
        _check_keys(entry, name, text, src)
        if not _field(entry, "retrain_enable", bool, where, default=True) or layers[name].excluded:
            continue
        d = _field(entry, "retrain_data_config", dict, where, default={})
        w = _field(entry, "retrain_weight_config", dict, where, default={})
        cmax = _field(d, "clip_max", (int, float), where + ".retrain_data_config")
        cmin = _field(d, "clip_min", (int, float), where + ".retrain_data_config")
        if (cmax is None) != (cmin is None):
            raise ConfigError(f"{where}.retrain_data_config: give both clip_max and clip_min or neither")
        if cmax is not None and not (math.isfinite(cmax) and cmax > 0 and math.isfinite(cmin) and cmin < 0):
            raise ConfigError(f"{where}.retrain_data_config: need clip_max > 0 > clip_min, got {cmax}, {cmin}")
        dst = {}
        for block, key, algos, known in ((d, "retrain_data_config", ("ulq_quantize",), ACTIVATION_FORMATS),
                                         (w, "retrain_weight_config", ("arq_retrain", "ulq_retrain"), WEIGHT_FORMATS)):
            if _field(block, "algo", str, where, default=algos[0]) not in algos:
                raise ConfigError(f"{where}: algo must be one of {algos}")
            dst[key] = _field(block, "dst_type", str, f"{where}.{key}", default="INT8")
            if dst[key] not in known and dst[key] not in WEIGHT_FORMATS:
                raise ConfigError(f"{where}.{key}.dst_type: {dst[key]!r} is not a format "
                                  f"({', '.join(sorted({*ACTIVATION_FORMATS, *WEIGHT_FORMATS}))})")
        act_type, wts_type = dst["retrain_data_config"], dst["retrain_weight_config"]
        try:
            format_pair(act_type, wts_type, layers[name].type,
                        f"{where} ({layers[name].type}): retrain_data_config.dst_type {act_type} / "
                        f"retrain_weight_config.dst_type {wts_type}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        act = ActSpec(clip_max=None if cmax is None else float(cmax), clip_min=None if cmin is None else float(cmin),
                      fixed_min=_field(d, "fixed_min", bool, where), dst_type=act_type)
        wts = WtsSpec(algo="ulq" if w.get("algo") == "ulq_retrain" else "arq",
                      channel_wise=_field(w, "channel_wise", bool, where, default=layers[name].type != "Linear"),
                      dst_type=wts_type)
        plan_layers[name].specs[technique] = QuantSpec(act, wts)
    plan = Plan(plan_layers, batch_num)
    if plan.is_empty():
        raise ConfigError(f"{src}: nothing to do: no layer has retrain_enable true")
    return plan
