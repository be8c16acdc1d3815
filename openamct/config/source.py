"""Where a plan comes from: a retrain .cfg (protobuf text), the QAT family's JSON, or, for the
QAT family without a config, every supported layer with default settings."""

from __future__ import annotations

from collections.abc import Mapping

from openamct.config.parse import parse_config_bytes, read_config_file
from openamct.config.plan import build_plan
from openamct.config.quant_json import is_json, plan_from_json
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig
from openamct.config.specs import Plan
from openamct.graph.layers import LayerInfo


def load_plan(path: str | None, layers: Mapping[str, LayerInfo], api: str, modules: Mapping[str, str],
              arg: str = "config_defination") -> Plan:
    if path is None:
        return build_plan(AMCTRetrainConfig(), layers, api, modules=modules, src="default config")
    raw = read_config_file(path, arg)
    src = f"{arg} {path!r}"
    if api == "quant" and is_json(raw):
        return plan_from_json(raw, layers, src)
    cfg, text = parse_config_bytes(raw, src)
    return build_plan(cfg, layers, api, modules=modules, text=text, src=src)
