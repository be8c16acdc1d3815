"""Concats whose output quantized layers read (GoogLeNet's and Inception's blocks): where the
cat's inputs are module outputs that only the cat reads, each of those modules gets the reading
layers' shared input quantizer as an output hook (``quant/residual.py``'s ``OutputQuantHook``).

Why: ONNX Runtime runs a Concat as QLinearConcat only when every input is a DequantizeLinear
and its output a QuantizeLinear, and the branch convs before it as QLinearConv only when their
outputs are quantized. With one quantizer on every input, the cat of grid values is on that
grid, so the readers' quantizer leaves it as it is: fake-quant and deploy compute the same
values, and every tensor of the block stays uint8 in deploy (the branch convs output straight
into the concat's scale, the Concat copies bytes).

The readers, through max pools (which pool the uint8 tensor, ``quantization._pooled_from``)
and reshapes, must be quantized layers (one input quantizer, checked when applied) or average
pools ORT runs in int8. A cat read by another cat only is part of that cat's site (Inception-E's
nested cats). A cat only average pools read (the last block before the classifier) has no reader
to share a quantizer with: it gets its own (``ActULQ``, initialised from the training batches
like the others, held by the module returning the cat as ``concat_quant``, so the checkpoint
carries its clips), hooked on its inputs and on that module's output, so that ORT runs
QLinearConcat and then QLinear(Global)AveragePool. Where average pools and layers read a cat
whose input max-pools another concat (on that one's grid: Inception's reduction blocks), the
module returning the cat is hooked with the readers' quantizer as well, so that the pools
average what QLinearConcat outputs (each input requantized to that grid).

ShuffleNetV2: ``x1, x2 = x.chunk(2)``, ``cat(x1, branch(x2))``, then the channel shuffle's
view/transpose/view. The readers are followed through the split (a half only concats read is
an input of the next site) and the shuffle; an input that splits an earlier concat's output is
on that one's grid, as a max-pooled one is. A split reads the site, so the module returning its
shuffle is hooked: the deploy file's Q/DQ sits before the split, the half passed on gets one of
the same qparams (``export/qdq_place.splits_onto_grid``), and ORT runs the split, reshapes and
transpose on uint8 and each concat as QLinearConcat (requantizing the half passed on, which the
hook does in fake-quant). One record entry per concat, named ``<scope>:<cat node>`` (and the
module whose output is hooked); a site with its own quantizer records its (scale, offset) too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from openamct.graph.graph import Graph
from openamct.graph.node import Node, TensorInfo
from openamct.quant.quantizers import ActULQ
from openamct.quant.residual import OutputQuantHook
from openamct.record import attrs
from openamct.record.scale_offset_record_pb2 import AttrType

__all__ = ["ConcatSite", "concat_sites", "hook_sites", "hooked_tensors", "record_sites"]

logger = logging.getLogger(__name__)

MAX_POOLS = {"MaxPool1d", "MaxPool2d", "MaxPool3d", "max_pool1d", "max_pool2d", "max_pool3d"}
AVG_POOLS = {"AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool2d", "avg_pool1d", "avg_pool2d",
             "avg_pool3d", "adaptive_avg_pool2d"}
MOVES = {"flatten", "reshape", "view", "contiguous", "transpose", "Flatten", "Identity"}
SPLITS = {"chunk"}  # ShuffleNetV2's channel split: one part to the next concat, one to a branch


@dataclass(frozen=True)
class ConcatSite:
    inputs: tuple[str, ...]  # modules whose outputs the cat reads: each gets an output hook
    layers: tuple[str, ...]  # the quantized layers reading the cat's output (one input quantizer)
    # the module returning the cat, whose output is hooked too (concat_sites), or None; where
    # no layer reads the cat it holds the site's own quantizer
    output: str | None = None


def site_name(node: Node) -> str:
    return f"{node.scope}:{node.name}" if node.scope else node.name


def _is_cat(n: Node | None) -> bool:
    return n is not None and n.kind == "function" and n.op == "cat" and len(n.outputs) == 1


def _only_cats_read(graph: Graph, t: TensorInfo) -> bool:
    users = graph.users(t)
    return not graph.is_output(t) and bool(users) and all(_is_cat(u) for u in users)


def _pooled_cat(t: TensorInfo) -> bool:
    """Whether ``t`` max-pools or splits (through max pools, splits and reshapes) a concat's
    output (Inception's pool branches, ShuffleNetV2's channel split)."""
    p = t.producer
    while p is not None and (p.op in MAX_POOLS or p.op in MOVES or p.op in SPLITS) and len(p.inputs) == 1:
        p = p.inputs[0].producer
    return _is_cat(p) and p is not t.producer


def _returned(graph: Graph, t: TensorInfo) -> str | None:
    """The module returning ``t`` or, through reshapes each alone reading the one before
    (ShuffleNetV2's channel shuffle), a reshape of it."""
    while graph.module_outputs.get(t.key) is None:
        users = graph.users(t)
        if graph.is_output(t) or len(users) != 1 or users[0].op not in MOVES or len(users[0].outputs) != 1:
            return None
        t = users[0].outputs[0]
    return graph.module_outputs[t.key]


def _reading_layers(graph: Graph, t: TensorInfo, planned: set[str], model, others: list | None = None) -> list[str] | None:
    """The quantized layers reading ``t`` (through max pools, reshapes and splits), or None
    where another op reads it; the average pools and splits reading it are added to ``others``."""
    if graph.is_output(t):
        return None
    layers = []
    others = [] if others is None else others
    for n in graph.users(t):
        if n.kind == "module" and n.name in planned and n.inputs and n.inputs[0] is t:
            layers.append(n.name)
            continue
        if n.op in SPLITS and len(n.inputs) == 1 and n.kind == "function":
            others.append(n)
            for o in n.outputs:  # a part only concats read: an input of the next site
                more = [] if _only_cats_read(graph, o) else _reading_layers(graph, o, planned, model, others)
                if more is None:
                    return None
                layers += more
            continue
        if len(n.inputs) != 1 or len(n.outputs) != 1 or n.inplace:
            return None
        if n.op in MAX_POOLS and _only_cats_read(graph, n.outputs[0]):
            continue  # an input of the next concat, on this one's grid (Inception's pool branch)
        if n.op in MAX_POOLS or n.op in MOVES:
            more = _reading_layers(graph, n.outputs[0], planned, model, others)
            if more is None:
                return None
            layers += more
        elif not int8_pool(model, n):
            return None
        else:
            others.append(n)
    return layers


def int8_pool(model, n: Node) -> bool:
    """An average pool ORT runs as QLinear(Global)AveragePool: not ceil_mode, whose windows
    hanging over the input ORT's kernel mis-averages (deploy._int8_pool)."""
    return n.op in AVG_POOLS and not n.kwargs.get("ceil_mode", False) and not (
        n.kind == "module" and getattr(model.get_submodule(n.name), "ceil_mode", False))


def _input_modules(graph: Graph, cat: Node, excluded: set[str], pooled: list) -> list[str] | None:
    """The modules returning the cat's inputs (through nested cats), each read by the cat alone;
    ``pooled`` gets the inputs that max-pool or split another concat's output."""
    found: list[str] = []

    def take(t: TensorInfo) -> bool:
        if graph.is_output(t) or len(graph.users(t)) != 1:
            return False
        if _is_cat(t.producer):
            return all(take(i) for i in t.producer.inputs)
        if _pooled_cat(t):
            pooled.append(t)
            return True  # on that concat's grid where it is a site: QLinearConcat requantizes it
        m = graph.module_outputs.get(t.key)
        if m is None or m in excluded or m in found:
            return False
        found.append(m)
        return True

    return found if cat.inputs and all(take(i) for i in cat.inputs) else None


def concat_sites(graph: Graph, planned: set[str], excluded: set[str], model) -> dict[str, ConcatSite]:
    """Record name -> site; ``excluded``: modules that may not take a hook (quantized layers,
    wrapped activations, other hooks' modules)."""
    sites = {}
    for node in graph:
        if not _is_cat(node) or any(_is_cat(u) for u in graph.users(node.outputs[0])):
            continue
        others, pooled = [], []
        layers = _reading_layers(graph, node.outputs[0], planned, model, others)
        if layers is None or not layers and not others:
            continue
        inputs = _input_modules(graph, node, excluded, pooled)
        if not inputs:
            continue
        output = None
        # Average pools alone read it: its own quantizer, held by the module returning the cat.
        # Average pools and layers read it, and an input max-pools another concat's output (on
        # that one's grid): the module returning the cat is hooked with the readers' quantizer
        # too, so the pools average what QLinearConcat outputs (Inception's reduction blocks).
        # A split reads it (ShuffleNetV2): the module returning its shuffle is hooked, so the
        # deploy file's Q/DQ sits before the split and the part passed on is on the grid.
        if not layers or pooled and others or any(n.op in SPLITS for n in others):
            output = _returned(graph, node.outputs[0])
            if output is None or output in excluded or output in inputs or \
                    not layers and hasattr(model.get_submodule(output), OWN_QUANTIZER):
                if not layers:
                    continue
                output = None  # the pools average (the split passes on) the float concat there
        sites[site_name(node)] = ConcatSite(tuple(inputs), tuple(layers), output)
    return sites


OWN_QUANTIZER = "concat_quant"  # the attribute holding a site's own quantizer


def hooked_tensors(graph: Graph, sites: dict[str, ConcatSite]) -> set[int]:
    """Keys of the tensors the sites' hooks quantize (their producers need no output quantizer)."""
    mods = {m for s in sites.values() for m in s.inputs}
    return {k for k, m in graph.module_outputs.items() if m in mods}


def hook_sites(model, sites: dict[str, ConcatSite], parts_of, batch_num: int) -> dict[str, object]:
    """Hook each site's input modules (and output module) with its readers' one input
    quantizer, or with its own (a new ``ActULQ`` on ``batch_num`` batches, held by the output
    module); returns site -> quantizer for the sites hooked (the others stay float)."""
    hooked = {}
    for name, site in sites.items():
        if not site.layers:
            aq = ActULQ(fixed_min=False, batch_num=batch_num)
            aq.layer_name = f"{name} (concat)"
            model.get_submodule(site.output).add_module(OWN_QUANTIZER, aq)
        else:
            qs = {id(q): q for n in site.layers if (q := parts_of(n).act_quant) is not None}
            if len(qs) != 1 or any(parts_of(n).act_quant is None for n in site.layers):
                logger.debug("%s: its readers %s do not share one input quantizer; left float", name, site.layers)
                continue
            (aq,) = qs.values()
        for m in site.inputs + ((site.output,) if site.output is not None else ()):
            model.get_submodule(m).register_forward_hook(OutputQuantHook(aq))
        hooked[name] = aq
    return hooked


def record_sites(sites: dict[str, ConcatSite], hooked: dict[str, object], entry) -> None:
    """One record entry per hooked site whose quantizer is initialised (``entry(name, op)``
    makes it): its inputs and readers; with its own quantizer, that module and its
    (scale, offset) (a shared one is recorded with its layers), and the output module hooked."""
    for name, aq in hooked.items():
        if not bool(aq.initialized):
            continue
        site = sites[name]
        node = entry(name, "concat")
        node.attr.add(name="inputs", type=AttrType.STRINGS, strings=[n.encode() for n in site.inputs])
        node.attr.add(name="layers", type=AttrType.STRINGS, strings=[n.encode() for n in site.layers])
        if site.output is not None:
            node.attr.add(name="output", type=AttrType.STRING, s=site.output.encode())
        if not site.layers:
            s, o = aq.scale_offset()
            node.attr.add(name="scale_d", type=AttrType.FLOATS, floats=[s])
            attrs.add_ints(node, "offset_d", [o])
