"""Resolve the per-layer plan: which layer is quantized and/or pruned, and how.

The priority rules live here and only here (SPEC §2):
- quantization: override_layer_configs > override_layer_types > skip lists > global; an
  override re-enables a skipped layer.
- pruning: override_layer_configs > override_layer_types > global, but a skip always wins.
- a missing half of a quant override takes defaults (ULQ / ARQ), never the global half.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping

from openamct.config.parse import ConfigError, locate
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig
from openamct.config.specs import (
    ActSpec,
    FilterSpec,
    LayerPlan,
    NMSpec,
    Plan,
    QuantSpec,
    WtsSpec,
)
from openamct.config.validate import has_prune, has_quant, validate_fields
from openamct.graph.layers import LayerInfo
from openamct.layer_types import ALL_TYPES, FILTER_TYPES, NM_TYPES, QUANT_TYPES
from openamct.prune.nm import nm_eligible

logger = logging.getLogger(__name__)

APIS = ("prune", "compressed", "quant")


def _check_api(cfg: AMCTRetrainConfig, api: str, text: str, src: str) -> None:
    if api == "prune" and has_quant(cfg):
        at = locate(text, "retrain_data_quant_config") or locate(text, "retrain_weight_quant_config")
        raise ConfigError(f"{src}: {at}quantization fields in a prune-only config: the prune API "
                          "(create/restore_prune_retrain_model) only prunes; use "
                          "create_compressed_retrain_model for pruning + quantization")
    if api == "quant" and (has_prune(cfg) or cfg.regular_prune_skip_layers or cfg.regular_prune_skip_types):
        at = locate(text, "prune_config") or locate(text, "regular_prune_skip")
        raise ConfigError(f"{src}: {at}pruning fields in a quantization-only config: the quant API only "
                          "quantizes; use create_compressed_retrain_model for pruning + quantization")
    if api == "prune" and not has_prune(cfg):
        raise ConfigError(f"{src}: nothing to do: the config has no prune_config (global or override)")
    if api == "compressed" and not (has_prune(cfg) or has_quant(cfg)):
        raise ConfigError(f"{src}: nothing to do: the config enables neither quantization "
                          "(retrain_data_quant_config / retrain_weight_quant_config) nor pruning (prune_config)")


def _check_names(cfg: AMCTRetrainConfig, layers: Mapping[str, LayerInfo], modules: Mapping[str, str],
                 text: str, src: str) -> None:
    lists = [("skip_layers", cfg.skip_layers), ("quant_skip_layers", cfg.quant_skip_layers),
             ("regular_prune_skip_layers", cfg.regular_prune_skip_layers),
             ("override_layer_configs.layer_name", [o.layer_name for o in cfg.override_layer_configs])]
    for field, names in lists:
        for name in names:
            if name in layers:
                if layers[name].excluded:
                    logger.warning("%s: %s names %r, which is left uncompressed: %s", src, field, name, layers[name].excluded)
                continue
            at = locate(text, field.split(".")[-1], name)
            if name in modules:
                raise ConfigError(f"{src}: {at}{field}: layer {name!r} is a {modules[name]}, not a supported "
                                  f"layer ({', '.join(ALL_TYPES)})")
            hint = difflib.get_close_matches(name, list(layers), n=3)
            hint_s = f"; did you mean {', '.join(map(repr, hint))}?" if hint else ""
            raise ConfigError(f"{src}: {at}{field}: layer {name!r} does not exist in the model{hint_s}")


def _check_types(cfg: AMCTRetrainConfig, text: str, src: str) -> None:
    prune_types = tuple(dict.fromkeys(FILTER_TYPES + NM_TYPES))
    lists = [("skip_layer_types", cfg.skip_layer_types, ALL_TYPES),
             ("quant_skip_types", cfg.quant_skip_types, QUANT_TYPES),
             ("regular_prune_skip_types", cfg.regular_prune_skip_types, prune_types)]
    for o in cfg.override_layer_types:
        allowed = ALL_TYPES
        if o.HasField("retrain_data_quant_config") or o.HasField("retrain_weight_quant_config"):
            allowed = QUANT_TYPES if not o.HasField("prune_config") else ALL_TYPES
        elif o.HasField("prune_config"):
            allowed = FILTER_TYPES if o.prune_config.HasField("filter_pruner") else NM_TYPES
        lists.append(("override_layer_types.layer_type", [o.layer_type], allowed))
    for field, types, allowed in lists:
        for t in types:
            if t not in allowed:
                at = locate(text, field.split(".")[-1], t)
                raise ConfigError(f"{src}: {at}{field}: {t!r} is not a supported layer type here; "
                                  f"use one of {', '.join(allowed)} (torch class names)")


def _f32(value: float) -> float:
    """The decimal the user wrote, not its float32 neighbour (0.4, not 0.4000000059604645)."""
    return float(f"{value:.7g}")


def _quant_spec(block, layer_type: str) -> QuantSpec | None:
    has_d, has_w = block.HasField("retrain_data_quant_config"), block.HasField("retrain_weight_quant_config")
    if not (has_d or has_w):
        return None
    act = ActSpec()
    if has_d and block.retrain_data_quant_config.HasField("ulq_quantize"):
        u = block.retrain_data_quant_config.ulq_quantize
        clips = (_f32(u.clip_max_min.clip_max), _f32(u.clip_max_min.clip_min)) if u.HasField("clip_max_min") else (None, None)
        act = ActSpec(clip_max=clips[0], clip_min=clips[1],
                      fixed_min=u.fixed_min if u.HasField("fixed_min") else None)
    wts = WtsSpec(channel_wise=layer_type != "Linear")
    if has_w:
        algo = block.retrain_weight_quant_config.WhichOneof("wts_algo") or "arq_retrain"
        w = getattr(block.retrain_weight_quant_config, algo)
        cw = w.channel_wise if w.HasField("channel_wise") else layer_type != "Linear"
        wts = WtsSpec(algo="ulq" if algo == "ulq_retrain" else "arq", channel_wise=cw)
    return QuantSpec(act, wts)


def _prune_spec(block) -> FilterSpec | NMSpec | None:
    if not block.HasField("prune_config"):
        return None
    p = block.prune_config
    if p.WhichOneof("prune_algo") == "filter_pruner":
        b = p.filter_pruner.balanced_l2_norm_filter_prune
        return FilterSpec(ratio=_f32(b.prune_ratio), ascend_optimized=bool(b.ascend_optimized))
    s = p.n_out_of_m_pruner.l1_selective_prune
    return NMSpec(update_freq=int(s.update_freq))


def _resolve(info: LayerInfo, cfg: AMCTRetrainConfig, api: str) -> LayerPlan:
    lp = LayerPlan(info.name, info.type)
    if info.excluded:
        lp.notes.append(f"excluded: {info.excluded}")
        return lp
    by_name = {o.layer_name: o for o in cfg.override_layer_configs}
    by_type = {o.layer_type: o for o in cfg.override_layer_types}
    chain = [b for b in (by_name.get(info.name), by_type.get(info.type)) if b is not None]

    if info.type in QUANT_TYPES and api != "prune":
        override = next((_quant_spec(b, info.type) for b in chain if _quant_spec(b, info.type)), None)
        skipped = (info.name in cfg.skip_layers or info.name in cfg.quant_skip_layers
                   or info.type in cfg.skip_layer_types or info.type in cfg.quant_skip_types)
        if override is not None:
            lp.quant = override
        elif skipped:
            lp.notes.append("quant: skipped")
        else:
            lp.quant = _quant_spec(cfg, info.type)
            if lp.quant is None and api == "quant":  # upstream's QAT family quantizes by default
                lp.quant = QuantSpec(ActSpec(), WtsSpec(channel_wise=info.type != "Linear"))

    if api != "quant":
        spec = next((_prune_spec(b) for b in chain if _prune_spec(b)), None) or _prune_spec(cfg)
        skipped = (info.name in cfg.skip_layers or info.name in cfg.regular_prune_skip_layers
                   or info.type in cfg.skip_layer_types or info.type in cfg.regular_prune_skip_types)
        if spec is None:
            pass
        elif skipped:
            lp.notes.append("prune: skipped (a skip list wins over overrides)")
        elif isinstance(spec, FilterSpec):
            if info.type not in FILTER_TYPES:
                lp.notes.append(f"filter prune: {info.type} is pruned only passively (as a consumer)")
            elif info.depthwise:
                lp.notes.append("filter prune: depthwise convs follow their input, never pruned actively")
            else:
                lp.prune = spec
        else:
            eligible, why_not = nm_eligible(info.module)
            if eligible:
                lp.prune = spec
            else:
                lp.notes.append(f"2:4: {why_not}")
    return lp


def build_plan(cfg: AMCTRetrainConfig, layers: Mapping[str, LayerInfo], api: str, *,
               modules: Mapping[str, str] | None = None, text: str = "", src: str = "config") -> Plan:
    """Validate ``cfg`` against the model's layers and resolve every layer's plan.

    ``modules`` maps every module name of the model to its class name (for messages about
    names that exist but are not supported layers).
    """
    if api not in APIS:
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    validate_fields(cfg, text, src)
    _check_types(cfg, text, src)
    _check_names(cfg, layers, modules or {}, text, src)
    _check_api(cfg, api, text, src)
    if cfg.HasField("fakequant_precision_mode"):
        logger.info("%s: fakequant_precision_mode has no effect: openamct's fake-quant runs in float32", src)
    plan = Plan({name: _resolve(info, cfg, api) for name, info in layers.items()}, cfg.batch_num)
    if plan.is_empty():
        raise ConfigError(f"{src}: nothing to do: the config selects no layer of this model "
                          f"(supported layers: {', '.join(list(layers)[:8]) or 'none'})")
    return plan
