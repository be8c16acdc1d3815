"""The distillation configs: upstream's AMCTDistillConfig text (.cfg, ``config_defination``) and
the JSON that ``create_distill_config`` writes and the other three functions read.

JSON layout (upstream's): ``{"version": 1, "batch_num": N, "group_size": G, "data_dump": bool,
"distill_group": [[block, ..., block], ...], "<layer>": {"quant_enable": bool,
"distill_data_config": {"algo": "ulq_quantize", "dst_type": "INT8", ["clip_max", "clip_min"],
["fixed_min"]}, "distill_weight_config": {"algo": "arq_distill"|"ulq_distill", "channel_wise":
bool, "dst_type": "INT8"|"INT4"}}, ...}``. A group trains from the input of its first block to
the output of its last one.

The quantization itself is the retrain family's: ``to_retrain_config`` turns a distillation
config into an AMCTRetrainConfig (``arq_distill`` -> ``arq_retrain``, the skip lists, the
overrides), so planning, the record and export are the ones the other families use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from google.protobuf import text_format

from openamct._atomic import atomic_write_bytes
from openamct.config.errors import ConfigError, locate
from openamct.config.parse import read_config_file
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig
from openamct.config.specs import Plan
from openamct.distill.distill_config_pb2 import AMCTDistillConfig
from openamct.techniques.quant_json import quant_entry

__all__ = ["INT4_DEPLOYABLE", "DistillJson", "parse_distill_cfg", "to_retrain_config", "plan_to_json",
           "read_distill_json", "json_to_retrain_text", "check_int4_types", "skip_wins", "check_skip_types"]

# The layer types whose INT4 weights the deploy model stores as 4-bit values ONNX Runtime runs
# with a 4-bit kernel (MatMulNBits); other types would deploy as 8-bit storage.
INT4_DEPLOYABLE = ("Linear",)

_ALGOS = MappingProxyType({"arq_distill": "arq_retrain", "ulq_distill": "ulq_retrain"})


def parse_distill_cfg(path: str, arg: str = "config_defination") -> tuple[AMCTDistillConfig, str]:
    raw = read_config_file(path, arg)
    where = f"{arg} {path!r}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    msg = AMCTDistillConfig()
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as exc:
        raise ConfigError(f"{where}: line {exc}") from None
    if msg.batch_num < 1:
        raise ConfigError(f"{where}: {locate(text, 'batch_num')}batch_num must be >= 1")
    if msg.group_size < 1:
        raise ConfigError(f"{where}: {locate(text, 'group_size')}group_size must be >= 1")
    return msg, text


def _data(src, dst) -> None:
    if src.HasField("ulq_quantize"):
        u, d = src.ulq_quantize, dst.ulq_quantize
        d.SetInParent()
        if u.HasField("clip_max_min"):
            d.clip_max_min.clip_max, d.clip_max_min.clip_min = u.clip_max_min.clip_max, u.clip_max_min.clip_min
        if u.HasField("fixed_min"):
            d.fixed_min = u.fixed_min
        if u.HasField("dst_type"):
            d.dst_type = u.dst_type


def _weight(src, dst) -> None:
    algo = src.WhichOneof("weights_quant_algo")
    if algo is None:
        return
    s = getattr(src, algo)
    d = getattr(dst, _ALGOS[algo])
    d.SetInParent()
    if s.HasField("dst_type"):
        d.dst_type = s.dst_type
    if s.HasField("channel_wise"):
        d.channel_wise = s.channel_wise


def to_retrain_config(cfg: AMCTDistillConfig) -> AMCTRetrainConfig:
    """The retrain config that quantizes as ``cfg`` says (the groups are not part of it)."""
    out = AMCTRetrainConfig(batch_num=cfg.batch_num)
    out.retrain_data_quant_config.ulq_quantize.SetInParent()  # quantization is what distill is for
    _data(cfg.distill_data_quant_config, out.retrain_data_quant_config)
    out.retrain_weight_quant_config.arq_retrain.SetInParent()
    if cfg.HasField("distill_weight_quant_config"):
        out.retrain_weight_quant_config.Clear()
        _weight(cfg.distill_weight_quant_config, out.retrain_weight_quant_config)
    for o in cfg.distill_override_layers:
        r = out.override_layer_configs.add(layer_name=o.layer_name)
        _data(o.distill_data_quant_config, r.retrain_data_quant_config)
        _weight(o.distill_weight_quant_config, r.retrain_weight_quant_config)
    for o in cfg.distill_override_layer_types:
        r = out.override_layer_types.add(layer_type=o.layer_type)
        _data(o.distill_data_quant_config, r.retrain_data_quant_config)
        _weight(o.distill_weight_quant_config, r.retrain_weight_quant_config)
    out.quant_skip_layers.extend(cfg.quant_skip_layers)
    out.quant_skip_types.extend(cfg.quant_skip_layer_types)
    return out


def skip_wins(plan: Plan, cfg: AMCTDistillConfig) -> None:
    """Upstream's distillation rule (its ``_generate_layer_config`` reads the skip lists first):
    a layer that ``quant_skip_layers`` / ``quant_skip_layer_types`` names stays float even when a
    ``distill_override_layers`` / ``distill_override_layer_types`` entry also matches it, unlike
    the retrain family, where an override re-enables a skipped layer. ``plan`` is edited."""
    names, types = set(cfg.quant_skip_layers), set(cfg.quant_skip_layer_types)
    for name, lp in plan.layers.items():
        if (name in names or lp.type in types) and lp.specs.pop("quant", None) is not None:
            lp.notes.append("quant: skipped (in distillation a skip list wins over overrides)")


def check_skip_types(cfg: AMCTDistillConfig, layers: Mapping, text: str, src: str) -> None:
    """Each type ``quant_skip_layer_types`` or ``distill_override_layer_types`` names is the
    type of a layer of the model, as upstream's distillation config checks ("not exist or
    supported"); a layer name that names none is refused the same way by the shared checks."""
    have = sorted({info.type for info in layers.values() if not info.excluded})
    lists = [("quant_skip_layer_types", list(cfg.quant_skip_layer_types)),
             ("distill_override_layer_types", [o.layer_type for o in cfg.distill_override_layer_types])]
    for field_name, types in lists:
        for t in types:
            if t not in have:
                raise ConfigError(f"{src}: {locate(text, field_name, t)}{field_name}: the model has no layer of type "
                                  f"{t!r} (its layers' types: {', '.join(have) or 'none'})")


def check_int4_types(plan: Plan, where: str) -> None:
    """INT4 weights only on layer types whose deploy model stores them as 4-bit values."""
    for name, lp in plan.layers.items():
        q = lp.quant
        if q is not None and q.wts.dst_type == "INT4" and lp.type not in INT4_DEPLOYABLE:
            raise ConfigError(f"{where}: layer {name!r} ({lp.type}): dst_type INT4 cannot be deployed as 4-bit "
                              f"weights on this layer type (INT4 deploys on {', '.join(INT4_DEPLOYABLE)}); "
                              "give it INT8 with an override or skip it")


@dataclass
class DistillJson:
    batch_num: int = 1
    group_size: int = 1
    data_dump: bool = False
    groups: list[list[str]] = field(default_factory=list)
    layers: dict[str, dict] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # layer -> its type, when known


def plan_to_json(plan: Plan, cfg: AMCTDistillConfig, groups: list[list[str]]) -> dict:
    data: dict = {"version": 1, "batch_num": cfg.batch_num, "group_size": cfg.group_size,
                  "data_dump": cfg.data_dump, "distill_group": groups}
    for name, lp in plan.layers.items():
        q = lp.quant
        entry: dict = {"quant_enable": q is not None}
        if q is not None:
            entry.update(quant_entry(q, "distill"))
        data[name] = entry
    return data


def write_json(path: str, data: dict) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=4) + "\n").encode("utf-8"))


def _get(obj: Mapping, key: str, types, where: str, default):
    v = obj.get(key, default)
    if not isinstance(v, types) or (isinstance(v, bool) and types is int):
        raise ConfigError(f"{where}.{key}: wrong type {type(v).__name__}")
    return v


def read_distill_json(path: str, arg: str = "config_file") -> DistillJson:
    raw = read_config_file(path, arg)
    src = f"{arg} {path!r}"
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{src}: not valid JSON (write it with create_distill_config): {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: the top level must be a JSON object")
    out = DistillJson(_get(data, "batch_num", int, src, 1), _get(data, "group_size", int, src, 1),
                      _get(data, "data_dump", bool, src, False))
    if out.batch_num < 1 or out.group_size < 1:
        raise ConfigError(f"{src}: batch_num and group_size must be >= 1")
    groups = _get(data, "distill_group", list, src, [])
    for i, g in enumerate(groups):
        if not isinstance(g, list) or not g or not all(isinstance(n, str) for n in g):
            raise ConfigError(f"{src}: distill_group[{i}] must be a non-empty list of module names")
    out.groups = [list(g) for g in groups]
    for name, entry in data.items():
        if name in ("version", "batch_num", "group_size", "data_dump", "distill_group"):
            continue
        if not isinstance(entry, dict):
            raise ConfigError(f"{src}: layer {name!r} must be an object")
        unknown = set(entry) - {"quant_enable", "distill_data_config", "distill_weight_config"}
        if unknown:
            raise ConfigError(f"{src}: layer {name!r}: unknown key {sorted(unknown)[0]!r}")
        out.layers[name] = entry
    return out


def _dtype(value, where: str) -> int:
    names = {"INT8": 1, "INT4": 0}
    if value not in names:
        raise ConfigError(f"{where}.dst_type: must be INT8 or INT4, got {value!r}")
    return names[value]


def json_to_retrain_text(cfg: DistillJson, src: str) -> str:
    """The AMCTRetrainConfig text that quantizes each JSON layer as its entry says."""
    out = AMCTRetrainConfig(batch_num=cfg.batch_num)  # no global settings: only the JSON's layers
    for name, entry in cfg.layers.items():
        where = f"{src}: layer {name!r}"
        if not _get(entry, "quant_enable", bool, where, True):
            out.quant_skip_layers.append(name)
            continue
        o = out.override_layer_configs.add(layer_name=name)
        d = _get(entry, "distill_data_config", dict, where, {})
        u = o.retrain_data_quant_config.ulq_quantize
        u.SetInParent()
        if d.get("algo", "ulq_quantize") != "ulq_quantize":
            raise ConfigError(f"{where}.distill_data_config.algo: must be ulq_quantize")
        u.dst_type = _dtype(d.get("dst_type", "INT8"), where + ".distill_data_config")
        if ("clip_max" in d) != ("clip_min" in d):
            raise ConfigError(f"{where}.distill_data_config: give both clip_max and clip_min or neither")
        if "clip_max" in d:
            u.clip_max_min.clip_max = float(d["clip_max"])
            u.clip_max_min.clip_min = float(d["clip_min"])
        if "fixed_min" in d:
            u.fixed_min = _get(d, "fixed_min", bool, where, False)
        w = _get(entry, "distill_weight_config", dict, where, {})
        algo = w.get("algo", "arq_distill")
        if algo not in _ALGOS:
            raise ConfigError(f"{where}.distill_weight_config.algo: must be one of {sorted(_ALGOS)}, got {algo!r}")
        r = getattr(o.retrain_weight_quant_config, _ALGOS[algo])
        r.SetInParent()
        r.dst_type = _dtype(w.get("dst_type", "INT8"), where + ".distill_weight_config")
        if "channel_wise" in w:
            r.channel_wise = _get(w, "channel_wise", bool, where, True)
    return text_format.MessageToString(out)
