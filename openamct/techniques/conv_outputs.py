"""Conv outputs that nothing after them rounds get a trained quantizer where that is safe, so
that the deploy file's QLinearConv rounds where training did.

Why: ONNX Runtime runs a Conv in integers only when its output is quantized (QLinearConv).
Where quantized layers read the output, their input quantizer gives it that. torchvision
MobileNetV3's squeeze-excitation reads a conv's ReLU output with a pool and a Mul, and nothing
rounds it there. A deploy-only quantizer (from an output observer's range) is a rounding step
that training never took (timm DLA's deploy file read 0.80 against fake-quant, when those steps
were on); leaving the conv float gives up its integer kernel (MobileNetV3-Large: 1.18x
quantize_static's latency). A trained quantizer on the ReLU's output gives both.

Which: a planned, non-transposed conv whose output, after its folded BatchNorm, only a ReLU or
ReLU6 module reads, and whose ReLU output only ops ORT runs in int8 (an Add, Mul or Concat) and
pools read: no quantized layer or wrapped activation (they round it themselves) and no float op
(a layer the config leaves float must read what it read before). Reshapes, zero padding, dropout and max pools are looked through
(they keep a tensor on its grid). Pools alone do not count: the deploy file's observer step
before a pool is averaged away (the demo's last conv). Nor does a path to a graph output, so the
model's outputs are never rounded. The ReLU module holds the quantizer (``ActULQ`` with its
minimum pinned at 0, as ``output_quant``) and a forward hook applies it; ORT drops a Relu before
a QuantizeLinear of zero point 0.

A conv whose output only LayerNorms read, through reshapes and permutes (ConvNeXt's depthwise
convs), takes an output quantizer (``LayerParts.out_quant``): torchvision ConvNeXt-T's deploy
file then runs at 0.73x quantize_static's latency, against 1.2x with those convs float. A
LayerNorm subclass counts as one (Hugging Face ConvNeXt's ``ConvNextLayerNorm``, read after its
depthwise convs and its patch-embedding conv): without it every such conv ran float there.

Not done: a conv that another float op reads (a GELU, an Add, a positional encoding) runs as a
float kernel in the deploy file. A trained output quantizer there kept ORT's run of the deploy
file on fake-quant, but OpenVINO 2026.4 then departed from it on torchvision MaxViT (0.93, a
well-conditioned net) and failed to compile timm EdgeNeXt.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from openamct.graph.graph import Graph
from openamct.graph.node import Node, TensorInfo
from openamct.quant.quantizers import ActULQ
from openamct.quant.residual import OutputQuantHook
from openamct.techniques.concat_sites import AVG_POOLS, MAX_POOLS

__all__ = ["OWN_QUANTIZER", "hook_relus", "norm_read_convs", "relu_sites"]

OWN_QUANTIZER = "output_quant"  # the attribute of a ReLU module holding its quantizer
# concat_sites' average pools, and a mean over the spatial axes (torchvision MNASNet: x.mean([2, 3]))
POOLS = AVG_POOLS | {"AdaptiveAvgPool1d", "AdaptiveAvgPool3d", "adaptive_avg_pool1d", "adaptive_avg_pool3d", "mean"}


def _relu(graph: Graph, t: TensorInfo) -> Node | None:
    """The ReLU (ReLU6) module that alone reads ``t``, called once."""
    users = graph.users(t)
    if graph.is_output(t) or len(users) != 1:
        return None
    n = users[0]
    one = len(n.inputs) == 1 and len(n.outputs) == 1 and n.inputs[0] is t
    return n if n.kind == "module" and n.op in ("ReLU", "ReLU6") and graph.call_of(n.name) is n and one else None


def _unrounded(graph: Graph, t: TensorInfo, reads_quantized: Callable[[Node, TensorInfo], bool],
               passes: Callable[[Node], bool], int8: Callable[[Node], bool]) -> bool:
    """Whether ops ORT runs in int8 (``int8``: an Add, Mul or Concat) read ``t`` and nothing
    else does but pools (through ``passes`` and max pools): no quantized layer, which rounds
    it itself, and no float op, which must read what fake-quant reads, such as a layer the
    config leaves float; nor a graph output."""
    found = {"layer": 0, "int8": 0, "other": 0}

    def walk(t: TensorInfo) -> None:
        found["other"] += int(graph.is_output(t))
        for n in graph.users(t):
            if reads_quantized(n, t):
                found["layer"] += 1
            elif passes(n) or n.op in MAX_POOLS and len(n.outputs) == 1 and len(n.inputs) == 1:
                walk(n.outputs[0])
            elif n.op not in POOLS:
                found["int8" if int8(n) else "other"] += 1

    walk(t)
    return found["int8"] > 0 and not found["layer"] and not found["other"]


def relu_sites(graph: Graph, convs: dict[str, TensorInfo], taken: set[str], hooked: set[int],
               reads_quantized: Callable[[Node, TensorInfo], bool], passes: Callable[[Node], bool],
               int8: Callable[[Node], bool]) -> dict[str, str]:
    """ReLU module -> the conv it follows (module docstring). ``convs``: planned conv -> its
    output after the folded BN, for the convs no other rule quantizes; ``taken``: modules
    already hooked; ``hooked``: tensor keys already quantized."""
    sites = {}
    for name, t in convs.items():
        relu = _relu(graph, t)
        if relu is None or relu.name in taken or t.key in hooked or relu.outputs[0].key in hooked:
            continue
        if _unrounded(graph, relu.outputs[0], reads_quantized, passes, int8):
            sites[relu.name] = name
    return sites


LAYER_NORMS = {"LayerNorm", "LayerNorm2d", "layer_norm"}
MOVES = {"Permute", "permute", "transpose"}  # a layout change before a channels-last LayerNorm


def _layer_norm(model: nn.Module, n: Node) -> bool:
    """A LayerNorm call, also a module subclassing ``nn.LayerNorm`` (Hugging Face's
    ``ConvNextLayerNorm`` / ``ConvNextV2LayerNorm``, whose channels-first form permutes around
    the norm: still a norm over each position's channels)."""
    if n.op in LAYER_NORMS:
        return True
    return n.kind == "module" and isinstance(model.get_submodule(n.name), nn.LayerNorm)


def norm_read_convs(graph: Graph, convs: dict[str, TensorInfo], hooked: set[int],
                    passes: Callable[[Node], bool], model: nn.Module) -> list[str]:
    """The convs of ``convs`` whose output only LayerNorms read, through ``passes`` and
    permutes (ConvNeXt's depthwise convs): they take an output quantizer."""
    found = []

    def only_norms(t: TensorInfo) -> bool:
        users = graph.users(t)
        if graph.is_output(t) or not users:
            return False
        return all(_layer_norm(model, n) and n.inputs and n.inputs[0] is t
                   or (passes(n) or n.op in MOVES) and len(n.outputs) == 1 and only_norms(n.outputs[0]) for n in users)

    for name, t in convs.items():
        if t.key not in hooked and _relu(graph, t) is None and only_norms(t):
            found.append(name)
    return found


def hook_relus(model: nn.Module, relus: dict[str, str], batch_num: int) -> dict[str, ActULQ]:
    """Each ReLU module gets its own quantizer (min pinned at 0) as ``output_quant`` and an
    output hook applying it; returns module -> quantizer."""
    hooked = {}
    for name in relus:
        aq = ActULQ(fixed_min=True, batch_num=batch_num)
        aq.layer_name = f"{name} (output)"
        module = model.get_submodule(name)
        module.add_module(OWN_QUANTIZER, aq)
        module.register_forward_hook(OutputQuantHook(aq))
        hooked[name] = aq
    return hooked
