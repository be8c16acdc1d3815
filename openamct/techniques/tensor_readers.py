"""Who reads a tensor between layers: the walks ``activation_quant`` decides its quantizers from.

A quantized tensor stays on its grid through zero padding, dropout, identity and reshapes
(``passes``); quantized layers and wrapped activations round it themselves; ONNX Runtime runs
Add, Mul, Concat and the average pools in int8 between DQ and Q (``int8_reader``); anything else
reads it in float. ``residual_sites`` finds the module outputs that a quantized layer and
residual Adds read (``quant/residual.py``).
"""

from __future__ import annotations

from torch import nn

from openamct.graph.graph import Graph
from openamct.graph.node import TensorInfo
from openamct.quant.covering_pool import covers_input
from openamct.techniques.concat_sites import int8_pool

__all__ = ["ACTIVATION_FUNCTIONS", "PASS_MODULES", "conv_layers", "int8_reader", "layer_output", "nearest_upsample", "passes",
           "producer_layer", "readers", "residual_readers", "residual_sites", "same_values"]

ACTIVATION_FUNCTIONS = ("silu", "sigmoid")  # the function nodes a wrapped activation class's forward is

# Modules that map a quantized tensor onto the same grid (zero padding: 0 is on every grid).
PASS_MODULES = {"ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "Identity", "Dropout", "Dropout1d", "Dropout2d",
                "Dropout3d"}


def producer_layer(graph: Graph, t: TensorInfo, planned: set[str]) -> str | None:
    p = t.producer
    while p is not None and p.kind == "module" and p.op == "Identity" and len(p.inputs) == 1:
        p = p.inputs[0].producer  # timm's ConvNormAct without an activation: nn.Identity()
    if p is None or p.kind != "module":
        return None
    if p.name in planned:
        return p.name
    if p.op.startswith("BatchNorm") and p.inputs and p.inputs[0].producer is not None:
        layer = p.inputs[0].producer
        if layer.kind == "module" and layer.name in planned and graph.single_bn_after(layer.name) == p.name:
            return layer.name
    return None


PASS_FUNCTIONS = {"flatten", "reshape", "view", "contiguous", "dropout", "identity"}
# Ops ONNX Runtime runs in int8 between DQ and Q (QLinearAdd/Mul/Concat/(Global)AveragePool)
INT8_FUNCTIONS = {"add", "mul", "cat", "adaptive_avg_pool2d", "avg_pool2d"}
INT8_MODULES = {"AdaptiveAvgPool2d", "AvgPool2d"}


def zero_pad(n) -> bool:
    mode = n.kwargs.get("mode", n.args[2] if len(n.args) > 2 else "constant")
    value = n.kwargs.get("value", n.args[3] if len(n.args) > 3 else 0.0)
    return n.op == "pad" and mode == "constant" and (value is None or float(value) == 0.0)


def passes(n) -> bool:
    if len(n.outputs) != 1 or len(n.inputs) != 1:
        return False
    if n.kind == "module":
        return n.op in PASS_MODULES
    return n.kind == "function" and (n.op in PASS_FUNCTIONS or zero_pad(n))


def nearest_upsample(model: nn.Module, n) -> bool:
    """A nearest-neighbour upsampling (``nn.Upsample``, ``F.interpolate``): it copies values, so
    what it reads on a grid it returns on it, and ORT runs it on uint8 (HRNet's fuse layers)."""
    if len(n.inputs) != 1 or len(n.outputs) != 1:
        return False
    if n.kind == "module" and n.op in ("Upsample", "UpsamplingNearest2d"):
        return getattr(model.get_submodule(n.name), "mode", "nearest") == "nearest"
    if n.kind == "function" and n.op == "interpolate":
        return n.kwargs.get("mode", n.args[3] if len(n.args) > 3 else "nearest") == "nearest"
    return False


def int8_reader(model: nn.Module, n) -> bool:
    if n.kind == "module" and n.op in INT8_MODULES:
        # ORT's QLinearAveragePool mis-averages a ceil_mode window hanging over the input, so
        # such a pool reads float, unless its window covers the input (HF EfficientNet's
        # pooler): it is then exported as a GlobalAveragePool (quant/covering_pool.py)
        pool = model.get_submodule(n.name)
        return not getattr(pool, "ceil_mode", False) or bool(n.inputs) and covers_input(pool, n.inputs[0].shape)
    # in-place ones too (HF ResNet's ``hidden += residual``): the quantizers' backward keeps only
    # their input (quant/ulq_act.py), so their output may be written over
    return n.kind == "function" and n.op in INT8_FUNCTIONS and not n.kwargs.get("ceil_mode", False)


def readers(graph: Graph, t: TensorInfo, planned: set[str], model: nn.Module,
             wrapped: set[str] = frozenset()) -> dict[str, int]:
    """Who reads ``t``, through ops that keep a quantized tensor on its grid: quantized layers
    and wrapped activations ("layer", they quantize it themselves), ops ORT runs in int8
    ("int8"), anything else or a graph output ("other")."""
    count = {"layer": 0, "int8": 0, "add": 0, "other": int(graph.is_output(t))}
    for n in graph.users(t):
        wraps = n.name in wrapped or n.kind == "function" and n.scope in wrapped and n.op in ACTIVATION_FUNCTIONS
        if (n.kind == "module" and n.name in planned or wraps) and n.inputs and n.inputs[0] is t:
            count["layer"] += 1
        elif passes(n) or nearest_upsample(model, n):
            for k, v in readers(graph, n.outputs[0], planned, model, wrapped).items():
                count[k] += v
        elif int8_reader(model, n):
            # an Add/Mul with a constant runs in float in ORT: counts as "other"
            binary = n.op in ("add", "mul")
            count["int8" if not binary or len(n.inputs) == 2 else "other"] += 1
            count["add"] += int(n.op == "add" and len(n.inputs) == 2)
        else:
            count["other"] += 1
    return count


def _no_op_dropout(model: nn.Module, n) -> bool:
    """A Dropout module with p = 0 (timm's ConvNormAct before every conv): training rescales
    nothing through it; any other dropout rescales what it passes in training."""
    return n.kind == "module" and float(getattr(model.get_submodule(n.name), "p", 1.0)) == 0.0


def _keeps_values(model: nn.Module, n) -> bool:
    """``passes``, and in training too: a dropout only with p = 0."""
    return passes(n) and (not n.op.lower().startswith("dropout") or _no_op_dropout(model, n))


def same_values(graph: Graph, t: TensorInfo, model: nn.Module) -> list[TensorInfo]:
    """``t`` and every tensor reached from it through ops that keep its values (identities,
    no-op dropouts, reshapes), in training as in eval."""
    found, todo = [], [t]
    while todo:
        t = todo.pop()
        found.append(t)
        todo += [n.outputs[0] for n in graph.users(t) if _keeps_values(model, n)]
    return found


def residual_readers(graph: Graph, t: TensorInfo, planned: set[str], convs: set[str], model: nn.Module) -> list[str] | None:
    """The quantized layers reading ``t`` when only they and residual Adds or average pools ORT
    runs in int8 do (through zero padding and reshapes), the Adds not writing into ``t`` and
    adding a quantized conv's output (``convs``, through its BN); else None. Pools count only
    where no concat returns ``t`` (concat_sites.py quantizes those): Inception-v3's stem max
    pool, which its first block's convs and average pool read. Not when the Add's other term is
    a Linear's: its QGemm outputs float, so the Add stays float in deploy and quantizing ``t``
    for it would only clip the residual stream (all-MiniLM-L6-v2: cosine to FP32 0.995 -> 0.991)."""
    layers, adds = [], 0

    def walk(t: TensorInfo) -> bool:
        nonlocal adds
        if graph.is_output(t):
            return False
        for n in graph.users(t):
            if n.kind == "module" and n.name in planned and n.inputs and n.inputs[0] is t:
                layers.append(n.name)
            elif n.kind == "function" and n.op == "add" and len(n.inputs) == 2 and not (n.inplace and n.inputs[0] is t):
                other = n.inputs[1] if n.inputs[0] is t else n.inputs[0]
                if producer_layer(graph, other, convs) is None:
                    return False
                adds += 1
            elif _keeps_values(model, n):
                if not walk(n.outputs[0]):
                    return False
            elif int8_pool(model, n) and len(n.inputs) == 1 and not (t.producer is not None and t.producer.op == "cat"):
                adds += 1
            else:
                return False
        return True

    return layers if walk(t) and layers and adds else None


def residual_sites(graph: Graph, planned: set[str], wrapped: set[str], convs: set[str], model: nn.Module) -> dict[str, list[str]]:
    # layers (through their folded BN) and wrapped activations quantize their outputs themselves
    own = {id(u) for name in planned if (t := layer_output(graph, name)) is not None
           for u in same_values(graph, t, model)}  # (also through an Identity or a no-op Dropout)
    sites, covered = {}, set()
    for node in graph:
        if node.kind == "module" and node.name in planned:
            continue
        for t in node.outputs:
            if id(t) in own or id(t) in covered:
                continue
            module = graph.module_outputs.get(t.key)
            layers = residual_readers(graph, t, planned, convs, model) if module is not None else None
            if layers and module not in sites:
                sites[module] = layers
                # the hook puts these on the grid too (an Identity or no-op Dropout after the site)
                covered |= {id(u) for u in same_values(graph, t, model)}
    return sites


def conv_layers(plans) -> set[str]:
    return {lp.name for lp in plans if lp.type.startswith("Conv") and not lp.type.startswith("ConvTranspose")}


def layer_output(graph: Graph, name: str) -> TensorInfo | None:
    """The tensor a conv's output becomes after its folded BatchNorm (if any)."""
    node = graph.call_of(name)
    if node is None or len(node.outputs) != 1:
        return None
    bn = graph.single_bn_after(name)
    if bn is None:
        return node.outputs[0]
    call = graph.call_of(bn)
    return call.outputs[0] if call is not None and len(call.outputs) == 1 else None
