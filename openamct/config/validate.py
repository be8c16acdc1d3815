"""Model-independent rules on field values (SPEC §2 'Validation')."""

from __future__ import annotations

import math
from collections.abc import Iterator

from openamct.config.parse import ConfigError, locate
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig, DataType

_DTYPE = {v: k for k, v in DataType.items()}


def blocks(cfg: AMCTRetrainConfig) -> Iterator[tuple[str, object]]:
    """(label, message) for the global config and each override, for messages."""
    yield "global", cfg
    for o in cfg.override_layer_configs:
        yield f"override_layer_configs[layer_name={o.layer_name!r}]", o
    for o in cfg.override_layer_types:
        yield f"override_layer_types[layer_type={o.layer_type!r}]", o


def has_quant(cfg: AMCTRetrainConfig) -> bool:
    return any(b.HasField("retrain_data_quant_config") or b.HasField("retrain_weight_quant_config")
               for _, b in blocks(cfg))


def has_prune(cfg: AMCTRetrainConfig) -> bool:
    return any(b.HasField("prune_config") for _, b in blocks(cfg))


def _check_dtype(value: int, field: str, where: str, text: str, src: str) -> None:
    name = _DTYPE.get(value, str(value))
    if name == "INT4":
        raise ConfigError(f"{src}: {locate(text, 'dst_type', 'INT4')}{where}.{field}: INT4 quantization-aware training is not supported; use INT8")
    if name != "INT8":
        raise ConfigError(f"{src}: {locate(text, 'dst_type', name)}{where}.{field}: only INT8 is supported, got {name}")


def validate_fields(cfg: AMCTRetrainConfig, text: str = "", src: str = "config") -> None:
    """Raise ConfigError for the first out-of-range or incomplete field."""
    if cfg.batch_num < 1:
        raise ConfigError(f"{src}: {locate(text, 'batch_num')}batch_num must be >= 1, got {cfg.batch_num}")
    for field, what, keys in (("override_layer_configs", "layer", [o.layer_name for o in cfg.override_layer_configs]),
                              ("override_layer_types", "type", [o.layer_type for o in cfg.override_layer_types])):
        twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
        if twice is not None:
            raise ConfigError(f"{src}: {field}: {what} {twice!r} is overridden twice; merge the two blocks into one")
    for where, b in blocks(cfg):
        if b.HasField("retrain_data_quant_config"):
            d = b.retrain_data_quant_config
            if d.HasField("ulq_quantize"):
                u = d.ulq_quantize
                _check_dtype(u.dst_type, "retrain_data_quant_config.ulq_quantize.dst_type", where, text, src)
                if u.HasField("clip_max_min"):
                    cmax, cmin = u.clip_max_min.clip_max, u.clip_max_min.clip_min
                    if not (math.isfinite(cmax) and cmax > 0):
                        raise ConfigError(f"{src}: {locate(text, 'clip_max')}{where}: clip_max must be a finite number > 0, got {cmax}")
                    if not (math.isfinite(cmin) and cmin < 0):
                        raise ConfigError(f"{src}: {locate(text, 'clip_min')}{where}: clip_min must be a finite number < 0, got {cmin}")
        if b.HasField("retrain_weight_quant_config"):
            w = b.retrain_weight_quant_config
            algo = w.WhichOneof("wts_algo")
            if algo is not None:
                _check_dtype(getattr(w, algo).dst_type, f"retrain_weight_quant_config.{algo}.dst_type", where, text, src)
        if b.HasField("prune_config"):
            p = b.prune_config
            kind = p.WhichOneof("prune_algo")
            if kind is None:
                raise ConfigError(f"{src}: {locate(text, 'prune_config')}{where}.prune_config is empty: "
                                  "give filter_pruner or n_out_of_m_pruner")
            if kind == "filter_pruner":
                if p.filter_pruner.WhichOneof("filter_algo") is None:
                    raise ConfigError(f"{src}: {locate(text, 'filter_pruner')}{where}.prune_config.filter_pruner is empty: "
                                      "give balanced_l2_norm_filter_prune { prune_ratio: ... }")
                r = p.filter_pruner.balanced_l2_norm_filter_prune.prune_ratio
                if not (0.0 < r < 1.0):  # also rejects NaN
                    raise ConfigError(f"{src}: {locate(text, 'prune_ratio')}{where}: prune_ratio must be in (0, 1), got {r}")
            else:
                if p.n_out_of_m_pruner.WhichOneof("n_out_of_m_algo") is None:
                    raise ConfigError(f"{src}: {locate(text, 'n_out_of_m_pruner')}{where}.prune_config.n_out_of_m_pruner is empty: "
                                      "give l1_selective_prune { n_out_of_m_type: M4N2 }")
