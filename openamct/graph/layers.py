"""Find the layers openamct can compress, and the ones it must leave alone and why."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from openamct.graph.graph import Graph
from openamct.graph.node import Node, TensorArg
from openamct.graph.parametrized import hook_reparametrized
from openamct.layer_types import (
    LAYER_TYPES,
    LayerType,
    features,
    is_depthwise,
    layer_type_of,
    unsupported_recurrent,
)
from openamct.log_summary import warn_grouped

logger = logging.getLogger(__name__)

# The methods that compute a layer's output. A subclass that redefines one computes something
# its base class does not (timm's Conv2dSame pads TF-"same" in its forward, StdConv2d
# standardises its weight there), and a compressed layer runs the base class's op in its place.
OUTPUT_METHODS = ("forward", "_conv_forward")


def own_forward(module: nn.Module, row: LayerType) -> str | None:
    """Why ``module`` must stay float because its class computes its own output, or None."""
    cls = getattr(type(module), "_layer_cls", type(module))  # a compressed layer: what it was
    base = row.cls or next(c for c in cls.__mro__ if c.__name__ == row.name)
    changed = [m for m in OUTPUT_METHODS if getattr(cls, m, None) is not getattr(base, m, None)]
    if not changed:
        return None
    return (f"its class {cls.__module__}.{cls.__qualname__} defines its own {changed[0]}, which the "
            f"compressed {row.name} would replace")


@dataclass
class LayerInfo:
    name: str
    type: str
    module: nn.Module
    excluded: str | None = None  # why the layer must not be compressed
    # (owner module, position among the F.linear calls of the owner's own code): a Linear the
    # owner never calls but computes as ``F.linear(x, lin.weight, lin.bias)`` (functional_linear)
    functional: tuple[str, int] | None = None

    @property
    def groups(self) -> int:
        return int(getattr(self.module, "groups", 1))

    @property
    def matrix(self) -> bool:
        """Linear-like (features on the input's last axis): Linear, Hugging Face Conv1D."""
        return LAYER_TYPES[self.type].matrix

    @property
    def depthwise(self) -> bool:
        return is_depthwise(self.module)

    @property
    def cin_per_group(self) -> int:
        m = self.module
        if self.matrix:
            return features(m)[0]
        return m.in_channels // m.groups


def parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every "<module>.<name>" that holds it (more than one: a shared weight)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}")
    return owners


def module_aliases(model: nn.Module) -> dict[int, list[str]]:
    """id(module) -> every name it is registered under (more than one: a module used twice)."""
    aliases: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(name)
    return aliases


NEVER_CALLED = "never called in the forward with input_data (used functionally or unused)"


def _tensor_arg(node: Node, pos: int, key: str):
    """The TensorInfo passed as argument ``pos`` / keyword ``key``; None if absent or not a tensor."""
    a = node.args[pos] if len(node.args) > pos else node.kwargs.get(key)
    return node.inputs[a.pos] if isinstance(a, TensorArg) else None


def functional_linear(name: str, module: nn.Module, model: nn.Module, readers: dict[str, list[Node]]
                      ) -> tuple[Node | None, str]:
    """The one ``F.linear(x, <name>.weight, <name>.bias)`` call of a Linear its owner never
    calls, or (None, why not). The call must read exactly this layer's weight and bias (or no
    bias when it has none), a computed input, and be made by a module above the layer, which
    the compressed layer's routing (``compressed/functional.py``) hooks."""
    if not isinstance(module, nn.Linear):  # (a subclass with its own forward is excluded before)
        return None, NEVER_CALLED
    w, b = f"{name}.weight", f"{name}.bias"
    nodes = {id(n): n for p in (w, b) for n in readers.get(p, [])}
    if not nodes:
        return None, NEVER_CALLED
    node = next(iter(nodes.values()))
    if len(nodes) != 1 or node.op != "linear":
        ops = ", ".join(sorted({n.op for n in nodes.values()}))
        return None, (f"{NEVER_CALLED}; its weight and bias are read by {len(nodes)} torch call(s) ({ops}), "
                      "not by exactly one F.linear")
    x, wt, bt = _tensor_arg(node, 0, "input"), _tensor_arg(node, 1, "weight"), _tensor_arg(node, 2, "bias")
    bias_ok = (bt is None and (len(node.args) < 3 or node.args[2] is None) and node.kwargs.get("bias") is None
               if module.bias is None else bt is not None and bt.param_name == b)
    if x is None or x.param_name is not None or wt is None or wt.param_name != w or not bias_ok:
        return None, (f"{NEVER_CALLED}; read by an F.linear call that does not take exactly its weight and bias "
                      "with a computed input")
    owner = node.scope
    if not name.startswith(owner + ".") if owner else False:
        return None, f"{NEVER_CALLED}; its F.linear call is made by {owner!r}, which does not hold the layer"
    cls = type(model.get_submodule(owner))
    if cls.__module__.startswith("torch.nn."):
        # nn.MultiheadAttention's out_proj (one the pipeline left as it is, compressed/attention.py):
        # its eval fast path reads the weight in a fused kernel that never calls F.linear, so the
        # routed layer would run in training only
        return None, (f"{NEVER_CALLED}; computed by F.linear inside torch's {cls.__name__}, whose fused paths "
                      "skip that call")
    return node, ""


def find_layers(model: nn.Module, graph: Graph) -> dict[str, LayerInfo]:
    """Every module of a supported type, in module order, with exclusions decided."""
    owners = parameter_owners(model)
    aliases = module_aliases(model)

    # Parameters a torch function reads directly (``F.linear(h, self.l1.weight)``) besides their
    # module's own call: compressing the module would give that second use a folded or
    # placeholder weight in export, unlike the float weight the trained model reads.
    readers: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.kind == "function":
            for i in n.inputs:
                if i.param_name and n not in readers.setdefault(i.param_name, []):
                    readers[i.param_name].append(n)
    functional = set(readers)
    layers: dict[str, LayerInfo] = {}
    for name, module in model.named_modules():
        row = layer_type_of(module)
        if row is None:
            continue
        kind = row.name
        info = LayerInfo(name, kind, module)
        calls = len(graph.module_calls.get(name, []))
        shared = [o for p in module.parameters(recurse=False) for o in owners.get(id(p), [])
                  if not o.startswith(name + ".")]
        hooked = hook_reparametrized(module)
        own = own_forward(module, row)
        unsupported = unsupported_recurrent(module) if row.recurrent else None
        if unsupported:
            info.excluded = unsupported
        elif hooked:
            info.excluded = hooked
        elif own:
            info.excluded = own
        elif len(aliases.get(id(module), [])) > 1:
            info.excluded = f"registered under several names ({', '.join(aliases[id(module)])})"
        elif calls == 0 and not shared:
            node, why = functional_linear(name, module, model, readers)
            if node is None:
                info.excluded = why
            else:
                own = [n for n in graph.nodes if n.kind == "function" and n.op == "linear" and n.scope == node.scope]
                info.functional = (node.scope, next(i for i, n in enumerate(own) if n is node))
                graph.functional_calls[name] = node
        elif calls == 0:
            info.excluded = NEVER_CALLED
        elif calls > 1:
            info.excluded = f"called {calls} times in one forward (reused module)"
        elif any(f"{name}.{p}" in functional for p, _ in module.named_parameters(recurse=False)):
            info.excluded = "its weight is also read outside its own forward (a functional use such as F.linear)"
        elif shared:
            info.excluded = f"shares its parameters with {', '.join(sorted(set(shared)))}"
        layers[name] = info
    warn_grouped(logger, "layer(s) left uncompressed",
                 [(f"{n} ({i.type})", i.excluded) for n, i in layers.items() if i.excluded])
    return layers
