"""Where a plan comes from, and the config path in order: parse -> validate -> plan.

A retrain .cfg (protobuf text), the QAT family's JSON (read by the quantization technique,
``techniques/quant_json.py``), or, for the QAT family without a config,
every supported layer with default settings. Each step runs once and hands its result on; no
step calls back into an earlier one. ``techniques`` is the registry in use: the techniques'
config slices validate and read their own fields.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from openamct.config.parse import parse_config_bytes, read_config_file
from openamct.config.plan import APIS, resolve_plan
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig
from openamct.config.rules import QUANT
from openamct.config.specs import Plan
from openamct.config.validate import validate_fields, validate_for_model
from openamct.graph.layers import LayerInfo

logger = logging.getLogger(__name__)


def build_plan(cfg: AMCTRetrainConfig, layers: Mapping[str, LayerInfo], api: str, *, techniques: Sequence,
               modules: Mapping[str, str] | None = None, text: str = "", src: str = "config") -> Plan:
    """Validate a parsed ``cfg`` against the model's layers, then resolve every layer's plan.

    ``modules`` maps every module name of the model to its class name (for messages about
    names that exist but are not supported layers).
    """
    if api not in APIS:
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    validate_fields(cfg, techniques, text, src)
    validate_for_model(cfg, layers, modules or {}, api, techniques, text, src)
    if cfg.HasField("fakequant_precision_mode"):
        logger.info("%s: fakequant_precision_mode has no effect: openamct's fake-quant runs in float32", src)
    return resolve_plan(cfg, layers, api, techniques, src)


def load_plan(path: str | None, layers: Mapping[str, LayerInfo], api: str, modules: Mapping[str, str],
              arg: str = "config_defination", *, techniques: Sequence) -> Plan:
    if path is None:
        return build_plan(AMCTRetrainConfig(), layers, api, techniques=techniques, modules=modules,
                          src="default config")
    raw = read_config_file(path, arg)
    src = f"{arg} {path!r}"
    if api == "quant" and raw.lstrip().startswith(b"{"):  # the QAT family's JSON: its technique reads it
        quant = next((t for t in techniques if t.family is QUANT), None)
        if quant is None:
            raise ValueError("the techniques in use have no quantization technique: a QAT JSON config needs one")
        return quant.plan_from_json(raw, layers, src)
    cfg, text = parse_config_bytes(raw, src)
    return build_plan(cfg, layers, api, techniques=techniques, modules=modules, text=text, src=src)
