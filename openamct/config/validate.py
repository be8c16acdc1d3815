"""The second step of the config path (parse -> validate -> plan): refuse a config before any
layer is planned.

``validate_fields`` checks values that need no model: the shared ones here (batch_num, an
override given twice), each technique's own fields in its ``validate_block``. ``validate_for_model``
checks the names and types against the model's layers (eligibility: the techniques' own
``layer_types``) and which rule families the public API allows. Nothing here plans a layer.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping, Sequence

from openamct.config.errors import ConfigError, locate
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig
from openamct.config.rules import FAMILIES, PRUNE, QUANT, blocks, config_order, uses
from openamct.graph.layers import LayerInfo
from openamct.layer_types import ALL_TYPES

logger = logging.getLogger(__name__)


def validate_fields(cfg: AMCTRetrainConfig, techniques: Sequence, text: str = "", src: str = "config") -> None:
    """Raise ConfigError for the first out-of-range or incomplete field."""
    if cfg.batch_num < 1:
        raise ConfigError(f"{src}: {locate(text, 'batch_num')}batch_num must be >= 1, got {cfg.batch_num}")
    for field, what, keys in (("override_layer_configs", "layer", [o.layer_name for o in cfg.override_layer_configs]),
                              ("override_layer_types", "type", [o.layer_type for o in cfg.override_layer_types])):
        twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
        if twice is not None:
            raise ConfigError(f"{src}: {field}: {what} {twice!r} is overridden twice; merge the two blocks into one")
    slices = config_order(techniques)
    for where, b in blocks(cfg):
        for t in slices:
            t.validate_block(b, where, text, src)


def _union(techniques: Sequence) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for t in techniques for n in t.layer_types))


def _check_types(cfg: AMCTRetrainConfig, techniques: Sequence, text: str, src: str) -> None:
    slices = config_order(techniques)
    lists = [("skip_layer_types", cfg.skip_layer_types, ALL_TYPES)]
    for family in FAMILIES:
        members = [t for t in slices if t.family is family]
        lists += [(f, getattr(cfg, f), _union(members)) for f in family.skip_types if f != "skip_layer_types"]
    for o in cfg.override_layer_types:
        configured = [t for t in slices if t.configured_by(o)]
        allowed = configured[0].layer_types if len(configured) == 1 else _union(configured) or ALL_TYPES
        if len({t.family for t in configured}) > 1:  # a block for both families: any supported type
            allowed = ALL_TYPES
        lists.append(("override_layer_types.layer_type", [o.layer_type], allowed))
    for field, types, allowed in lists:
        for t in types:
            if t not in allowed:
                at = locate(text, field.split(".")[-1], t)
                raise ConfigError(f"{src}: {at}{field}: {t!r} is not a supported layer type here; "
                                  f"use one of {', '.join(allowed)} (torch class names)")


def _warn_absent_types(cfg: AMCTRetrainConfig, layers: Mapping[str, LayerInfo], src: str) -> None:
    """A type entry that names no layer of this model does nothing: one WARNING for all of them
    (a layer *name* that names no layer is an error; a type may be a config shared by models)."""
    have = {info.type for info in layers.values()}
    fields = ("skip_layer_types", "quant_skip_types", "regular_prune_skip_types")
    absent = [(f, t) for f in fields for t in getattr(cfg, f) if t not in have]
    absent += [("override_layer_types", o.layer_type) for o in cfg.override_layer_types if o.layer_type not in have]
    if absent:
        logger.warning("%s: %s name(s) no layer type of this model and do nothing (its layer types: %s)", src,
                       ", ".join(f"{f} {t!r}" for f, t in absent), ", ".join(sorted(have)) or "none")


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


def _check_api(cfg: AMCTRetrainConfig, api: str, text: str, src: str) -> None:
    has_quant, has_prune = uses(cfg, QUANT), uses(cfg, PRUNE)
    if api == "prune" and has_quant:
        at = locate(text, "retrain_data_quant_config") or locate(text, "retrain_weight_quant_config")
        raise ConfigError(f"{src}: {at}quantization fields in a prune-only config: the prune API "
                          "(create/restore_prune_retrain_model) only prunes; use "
                          "create_compressed_retrain_model for pruning + quantization")
    if api == "quant" and (has_prune or cfg.regular_prune_skip_layers or cfg.regular_prune_skip_types):
        at = locate(text, "prune_config") or locate(text, "regular_prune_skip")
        raise ConfigError(f"{src}: {at}pruning fields in a quantization-only config: the quant API only "
                          "quantizes; use create_compressed_retrain_model for pruning + quantization")
    if api == "prune" and not has_prune:
        raise ConfigError(f"{src}: nothing to do: the config has no prune_config (global or override)")
    if api == "compressed" and not (has_prune or has_quant):
        raise ConfigError(f"{src}: nothing to do: the config enables neither quantization "
                          "(retrain_data_quant_config / retrain_weight_quant_config) nor pruning (prune_config)")


def validate_for_model(cfg: AMCTRetrainConfig, layers: Mapping[str, LayerInfo], modules: Mapping[str, str],
                       api: str, techniques: Sequence, text: str = "", src: str = "config") -> None:
    """Raise ConfigError for a type, layer name or rule family this model or API does not allow."""
    _check_types(cfg, techniques, text, src)
    _warn_absent_types(cfg, layers, src)
    _check_names(cfg, layers, modules, text, src)
    _check_api(cfg, api, text, src)
