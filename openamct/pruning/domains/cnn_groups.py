"""The CNN domain's units: openamct's channel-dependency analysis run with every conv as a
producer, each coupled group one ``Unit``; ``upstream_rules`` drops the groups upstream's CNN
domain skips, so the two reaches can be compared.

A group is what filter pruning removes together (``openamct.sparsity.dependency``): a producer
conv, the BatchNorms and depthwise convs that follow its channels, the element-wise ops that
couple it with other producers (a residual add: the stem, every block's last conv and the
downsample conv of a ResNet stage are one group), the concats that place its channels in a wider
tensor, and the consumers (conv / linear layers) that read them.
"""

from __future__ import annotations

from torch import nn

from openamct.config.specs import LayerPlan, Plan
from openamct.graph.capture import capture_graph
from openamct.graph.layers import find_layers
from openamct.pruning.domains.base import Unit
from openamct.sparsity.dependency import analyse
from openamct.sparsity.group import PruneGroup
from openamct.techniques.filter_prune import FilterPruning, FilterSpec

__all__ = ["PRODUCER_TYPES", "find_units", "upstream_skip"]

# Layer types that start a unit. Linear producers (an MLP head, attention projections) belong to
# the dense domain; a Linear still takes part here as a consumer of conv channels (a classifier).
PRODUCER_TYPES = ("Conv2d",)
# Any ratio works: the analysis only needs a spec to treat a layer as pruned; the domain's keep
# masks decide the channels.
_SPEC = FilterSpec(ratio=0.5, ascend_optimized=False)
_OWNER_TYPES = ("BatchNormalization",)


def upstream_skip(g: PruneGroup) -> str | None:
    """Why upstream's CNN domain would leave group ``g`` alone (None: it prunes it). Upstream
    prunes a conv whose channels go through at most a BatchNorm to plain conv / linear
    consumers; it skips a conv feeding a residual add, Concat consumers, and grouped or
    depthwise convs."""
    kinds = {m.op_type for m in g.members() if m.is_function}
    if len(g.producers) > 1 or kinds & {"Add", "Sub", "Mul", "Div"}:
        return "feeds a residual add"
    if "Concat" in kinds:
        return "read through a concat"
    if any(m.group > 1 for m in g.members()) or any(m.op_type == "Conv" for m in g.passive):
        return "involves a grouped or depthwise conv"
    if any(m.op_type not in _OWNER_TYPES for m in g.passive):
        return "its channels pass a per-channel owner other than a BatchNorm"
    return None


def _positions(m: nn.Module, role: str) -> int:
    """How many channel positions module ``m`` has on the axis a member of ``role`` is cut on."""
    if role == "consumer":
        return int(getattr(m, "in_channels", None) or getattr(m, "in_features", None) or 0)
    for attr in ("out_channels", "out_features", "num_features", "num_channels"):
        if getattr(m, attr, None):
            return int(getattr(m, attr))
    shape = getattr(m, "normalized_shape", None)
    return int(shape[0]) if shape else 0


def _params_per_channel(modules: dict[str, nn.Module], params: dict[str, nn.Parameter], g: PruneGroup) -> int:
    """Parameters one channel of ``g`` takes away: its producers' rows, BatchNorm / depthwise
    entries, its consumers' columns. Where a conv is a consumer of one unit and a producer of
    another, the weights at both cuts are counted by both units (a first-order figure)."""
    total = 0
    for m in g.members():
        if m.is_function:
            continue
        if m.op_type == "Parameter":
            total += m.repeat
            continue
        mod = modules.get(m.name)
        n = _positions(mod, m.role) if mod is not None else 0
        if not n:
            continue
        if m.role == "consumer":
            numel = mod.weight.numel()
        else:
            numel = sum(p.numel() for p in mod.parameters(recurse=False))
        total += numel // n * m.repeat
    return total


def find_units(model: nn.Module, example_inputs, upstream_rules: bool,
               ) -> tuple[list[tuple[Unit, PruneGroup]], dict[str, str]]:
    """Every prunable coupled group of ``model`` run on ``example_inputs`` as (unit, group), and
    each conv / linear layer whose output goes to a BatchNorm alone, with that BatchNorm (where
    reconstruction puts the bias of a layer that has none)."""
    graph = capture_graph(model, example_inputs)
    layers = find_layers(model, graph)
    technique = FilterPruning()
    plan = Plan({name: LayerPlan(name, info.type, {"filter_prune": _SPEC}
                                 if info.type in PRODUCER_TYPES and not info.excluded
                                 and technique.eligible(info) is None else {})
                 for name, info in layers.items()})
    groups, _ = analyse(graph, layers, plan, model)
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    found = []
    for g in groups:
        if upstream_rules and upstream_skip(g) is not None:
            continue
        members = tuple(dict.fromkeys(m.name for m in g.members() if not m.is_function))
        unit = Unit(g.producers[0].name, g.channels, _params_per_channel(modules, params, g), members,
                    {"prune_group": g.prune_group, "producers": tuple(g.producer_names)})
        found.append((unit, g))
    bn_after = {name: bn for name in layers if (bn := graph.single_bn_after(name)) is not None}
    return found, bn_after
