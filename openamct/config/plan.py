"""The third step of the config path (parse -> validate -> plan): each layer's plan, built from
the techniques' config slices.

For every supported layer, every technique whose rule family the API applies gets to read its
slice (``Technique.layer_spec``, which uses the shared priority rules of ``config.rules``); a
slice it returns is stored under the technique's name. This module reads no technique's fields;
a config that selects nothing is refused here, since only the plan knows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from openamct.config.errors import ConfigError
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig
from openamct.config.rules import config_order
from openamct.config.specs import LayerPlan, Plan
from openamct.graph.layers import LayerInfo

APIS = ("prune", "compressed", "quant")


def _resolve(info: LayerInfo, cfg: AMCTRetrainConfig, api: str, slices: Sequence) -> LayerPlan:
    lp = LayerPlan(info.name, info.type)
    if info.excluded:
        lp.notes.append(f"excluded: {info.excluded}")
        return lp
    for t in slices:
        if api in t.family.apis:
            spec = t.layer_spec(cfg, info, api, lp.notes)
            if spec is not None:
                lp.specs[t.name] = spec
    return lp


def resolve_plan(cfg: AMCTRetrainConfig, layers: Mapping[str, LayerInfo], api: str, techniques: Sequence,
                 src: str = "config") -> Plan:
    """Every layer's plan from a validated ``cfg``; ConfigError when it selects no layer."""
    slices = config_order(techniques)
    plan = Plan({name: _resolve(info, cfg, api, slices) for name, info in layers.items()}, cfg.batch_num,
                activation_matmul=cfg.quantize_activation_matmul)
    if plan.is_empty():
        raise ConfigError(f"{src}: nothing to do: the config selects no layer of this model "
                          f"(supported layers: {', '.join(list(layers)[:8]) or 'none'})")
    return plan
