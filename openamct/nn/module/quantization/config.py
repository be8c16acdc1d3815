"""The ``config`` dict of a single-op QAT module, checked and turned into the graph flow's specs.

Layout (upstream AMCT's single-op config; every key optional)::

    {"retrain_enable": True,
     "retrain_data_config": {"dst_type": "INT8", "batch_num": 1, "fixed_min": False,
                             "clip_min": -1.0, "clip_max": 1.0},
     "retrain_weight_config": {"dst_type": "INT8", "weights_retrain_algo": "arq_retrain",
                               "channel_wise": True}}

Defaults are upstream's: retrain_enable true, INT8 data and weights, batch_num 1, fixed_min
false, clips learned from the first ``batch_num`` batches, ``arq_retrain``. ``channel_wise``
defaults as in the graph flow: per output channel for convolutions, per tensor for Linear.
``weights_retrain_algo`` takes upstream's names ``arq_retrain`` and ``ulq_quantize`` (and the
graph flow's JSON name ``ulq_retrain`` for the latter).

The result is the graph flow's own ``ActSpec``/``WtsSpec`` (``openamct.config.specs``), so a
QAT module builds its quantizers with the functions ``create_quant_retrain_model`` uses and
trains with the same numerics.

Refused, with an error naming the key: a key that is not one of the above (a typo would be
ignored silently otherwise), a value of the wrong type, a batch_num below 1, non-finite clips,
only one of clip_min/clip_max, clip_max <= 0 or clip_min >= 0, and a pair of data and weight
formats ``openamct.formats.PAIRS`` does not list for single-op modules: A8W8, A8W4 (INT4
weights) and A16W8 (INT16 data, beyond upstream's single-op page, which lists INT8 only) are
accepted; A4W4/A4W8 and A16W4 are refused with upstream's reason. No torch exporter writes a
16-bit fake quant, so a module exports INT16 data as float ops that ``convert_qat_model`` turns
into ONNX Runtime's int16 Q/DQ; nor a 4-bit one, so an INT4 weight is clamped into the INT4
range and written with the 8-bit Q/DQ of the same scale (``quant.functions.fake_quant_per_channel``),
whose values the converted deploy model stores as 4 bits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from openamct.formats import (
    DEFAULT,
    QAT_MODULE_ACTIVATION_FORMATS,
    REFUSED_PAIRS,
    WEIGHT_FORMATS,
    format_pair,
    pair_name,
)
from openamct.techniques.quantization import ActSpec, QuantSpec, WtsSpec

__all__ = ["QatConfig", "parse_qat_config", "TOP_KEYS", "DATA_KEYS", "WEIGHT_KEYS", "WEIGHT_ALGOS"]

TOP_KEYS = ("retrain_enable", "retrain_data_config", "retrain_weight_config")
DATA_KEYS = ("dst_type", "batch_num", "fixed_min", "clip_min", "clip_max")
WEIGHT_KEYS = ("dst_type", "weights_retrain_algo", "channel_wise")
# upstream's names (and the graph flow's JSON name of ULQ) -> the spec's algorithm
WEIGHT_ALGOS = {"arq_retrain": "arq", "ulq_quantize": "ulq", "ulq_retrain": "ulq"}

# Formats the single-op export can deploy; the rest of each role's formats is refused with a reason.
SINGLE_OP_DATA = tuple(QAT_MODULE_ACTIVATION_FORMATS)  # INT8, INT16
SINGLE_OP_WEIGHTS = tuple(WEIGHT_FORMATS)  # INT8, INT4


@dataclass(frozen=True)
class QatConfig:
    """A checked single-op config. ``quant`` is None when ``retrain_enable`` is false (the
    module then runs as its float class). ``batch_num``: the batches that initialise the
    activation clips (when no clips are given)."""

    retrain_enable: bool
    quant: QuantSpec | None
    batch_num: int = 1


def _block(value: Any, where: str) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{where}: expected a dict, got {type(value).__name__}")
    return value


def _check_keys(block: Mapping, allowed: tuple[str, ...], where: str) -> None:
    for key in block:
        if key not in allowed:
            raise ValueError(f"{where}: unknown key {key!r} (allowed: {', '.join(allowed)})")


def _get(block: Mapping, key: str, types: type | tuple, where: str, default: Any = None) -> Any:
    if key not in block:
        return default
    value = block[key]
    numeric = types in (int, float, (int, float))
    if not isinstance(value, types) or (numeric and isinstance(value, bool)):
        want = {bool: "a bool", str: "a str", int: "an int", (int, float): "a number"}.get(types, str(types))
        raise TypeError(f"{where}.{key}: expected {want}, got {type(value).__name__} {value!r}")
    return value


def _dst_type(block: Mapping, where: str, allowed: tuple[str, ...], known: Mapping, weights: bool) -> str:
    name = _get(block, "dst_type", str, where, DEFAULT)
    if name in allowed:
        return name
    if not weights and name in WEIGHT_FORMATS:
        raise ValueError(f"{where}.dst_type: {name} is a weight format; data takes {', '.join(allowed)} "
                         f"({REFUSED_PAIRS.get(pair_name(name, DEFAULT), '')})")
    raise ValueError(f"{where}.dst_type: {name!r} is not a format ({', '.join(sorted(known))}); "
                     f"the single-op QAT modules take {', '.join(allowed)}")


def _clips(d: Mapping, where: str) -> tuple[float | None, float | None]:
    # None is "not given": upstream's single-op example writes "clip_min": None, "clip_max": None
    cmax = None if d.get("clip_max") is None else _get(d, "clip_max", (int, float), where)
    cmin = None if d.get("clip_min") is None else _get(d, "clip_min", (int, float), where)
    if (cmax is None) != (cmin is None):
        missing = "clip_min" if cmin is None else "clip_max"
        raise ValueError(f"{where}: give both clip_max and clip_min or neither ({missing} is missing)")
    if cmax is None:
        return None, None
    if not math.isfinite(cmax) or cmax <= 0:
        raise ValueError(f"{where}.clip_max: must be a finite number > 0, got {cmax!r}")
    if not math.isfinite(cmin) or cmin >= 0:
        raise ValueError(f"{where}.clip_min: must be a finite number < 0, got {cmin!r}")
    return float(cmax), float(cmin)


def parse_qat_config(config: Any, layer_type: str, where: str = "config") -> QatConfig:
    """Check ``config`` (a dict or None) for a layer of ``layer_type`` (its torch class name:
    "Conv2d", "Linear"...) and return its ``QatConfig``; errors name ``where`` and the key."""
    top = _block(config, where)
    _check_keys(top, TOP_KEYS, where)
    enable = _get(top, "retrain_enable", bool, where, True)
    dwhere, wwhere = f"{where}.retrain_data_config", f"{where}.retrain_weight_config"
    d = _block(top.get("retrain_data_config"), dwhere)
    w = _block(top.get("retrain_weight_config"), wwhere)
    _check_keys(d, DATA_KEYS, dwhere)
    _check_keys(w, WEIGHT_KEYS, wwhere)
    # Every field is checked even when retrain_enable is false: a typo there is still a typo.
    batch_num = _get(d, "batch_num", int, dwhere, 1)
    if batch_num < 1:
        raise ValueError(f"{dwhere}.batch_num: must be >= 1, got {batch_num}")
    fixed_min = _get(d, "fixed_min", bool, dwhere, False)
    cmax, cmin = _clips(d, dwhere)
    data_type = _dst_type(d, dwhere, SINGLE_OP_DATA, QAT_MODULE_ACTIVATION_FORMATS, False)
    algo_name = _get(w, "weights_retrain_algo", str, wwhere, "arq_retrain")
    if algo_name not in WEIGHT_ALGOS:
        raise ValueError(f"{wwhere}.weights_retrain_algo: {algo_name!r} is not one of {', '.join(WEIGHT_ALGOS)}")
    channel_wise = _get(w, "channel_wise", bool, wwhere, layer_type != "Linear")
    weight_type = _dst_type(w, wwhere, SINGLE_OP_WEIGHTS, WEIGHT_FORMATS, True)
    format_pair(data_type, weight_type, layer_type, f"{dwhere}.dst_type / {wwhere}.dst_type", single_op=True)
    if not enable:
        return QatConfig(False, None, batch_num)
    act = ActSpec(clip_max=cmax, clip_min=cmin, fixed_min=fixed_min, dst_type=data_type)
    wts = WtsSpec(algo=WEIGHT_ALGOS[algo_name], channel_wise=channel_wise, dst_type=weight_type)
    return QatConfig(True, QuantSpec(act, wts), batch_num)
