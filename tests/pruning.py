"""Filter pruning's analysis on a model, as the dependency tests drive it: capture, find the
layers, plan every eligible one at one ratio, analyse the groups and select the channels."""

from __future__ import annotations

from openamct.config.specs import LayerPlan, Plan
from openamct.graph.capture import capture_graph
from openamct.graph.layers import find_layers
from openamct.sparsity.dependency import analyse
from openamct.sparsity.filter import score_and_select
from openamct.techniques.filter_prune import FilterSpec


def select_filters(model, inputs, ratio: float = 0.5, ascend: bool = False,
                   types: tuple[str, ...] | None = ("Conv2d", "Linear")):
    """(groups, blocked) with channels selected; ``types=None`` plans every layer, depthwise
    ones included, otherwise the non-depthwise layers of those types."""
    graph = capture_graph(model, inputs)
    layers = find_layers(model, graph)
    plan = Plan({n: LayerPlan(n, i.type, {"filter_prune": FilterSpec(ratio, ascend)}) for n, i in layers.items()
                 if types is None or (i.type in types and not i.depthwise)})
    groups, blocked = analyse(graph, layers, plan, model)
    score_and_select(model, groups)
    return groups, blocked
