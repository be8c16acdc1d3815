"""Capture the dataflow graph of a model by running it once on ``input_data``.

Why this tracer: we *execute* the forward under a ``TorchFunctionMode`` and forward hooks
instead of using ``torch.fx`` (fails on data-dependent control flow, which Hugging Face
models have) or ``torch.export`` (30x slower at 258 layers, docs/dev/platform.md) or an
ONNX export (slower still, and it loses module names). Every torch function call outside
an opaque module is recorded with its tensor inputs/outputs and non-tensor arguments;
built-in leaf modules (Conv2d, BatchNorm2d, ReLU, ...) and leaf modules that own
parameters are recorded as one node named by their module path, which is the name users
write in configs. Control flow simply happens; the graph is the path this input took.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from openamct.graph.graph import Graph
from openamct.graph.node import Node, TensorArg, TensorInfo

logger = logging.getLogger(__name__)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _is_opaque(module: nn.Module) -> bool:
    """Leaf modules are single ops, unless they are parameter-free user code we can look into.
    Our own wrappers (``_openamct_leaf``) are single ops too, though they hold quantizers."""
    if getattr(module, "_openamct_leaf", False):
        return True
    if isinstance(module, _CONTAINERS) or next(module.children(), None) is not None:
        return False
    builtin = type(module).__module__.startswith("torch.nn.")
    owns_state = bool(module._parameters) or bool(module._buffers)
    return builtin or owns_state


# functionals whose second positional argument is ``inplace``
INPLACE_FLAG = {"relu", "relu6", "hardswish", "hardsigmoid", "silu", "mish", "selu"}


def _op_name(func: Any) -> tuple[str, bool]:
    """Normalise a torch function to (op, inplace): Tensor.__iadd__ -> ("add", True)."""
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # a property such as Tensor.T
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    inplace = False
    if name.startswith("__i") and name.endswith("__") and name not in ("__init__", "__iter__", "__index__", "__int__", "__invert__"):
        name, inplace = name[3:-2], True
    elif name.startswith("__r") and name.endswith("__") and name not in ("__repr__", "__reduce__", "__reduce_ex__"):
        name = name[3:-2]
    elif name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    elif name.endswith("_") and not name.startswith("_"):
        name, inplace = name[:-1], True
    return name, inplace


def flatten_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors inside nested tuples/lists/dicts (and dict-like model outputs), in order."""
    found: list[torch.Tensor] = []
    _walk(obj, found)
    return found


def _walk(o: Any, found: list[torch.Tensor]) -> None:
    # Not a closure: a nested function that calls itself is a reference cycle, which kept every
    # list it filled (and their tensors) alive until the garbage collector ran.
    if isinstance(o, torch.Tensor):
        found.append(o)
    elif isinstance(o, (list, tuple)):
        for item in o:
            _walk(item, found)
    elif isinstance(o, dict):
        for item in o.values():
            _walk(item, found)


class _Builder:
    """Accumulates nodes while the model runs; owns no global state."""

    def __init__(self, model: nn.Module) -> None:
        self.nodes: list[Node] = []
        # id(tensor) -> (weak reference to it, its info). Weak: a forward frees each activation
        # once its last reader has run, and so does the capture (holding them all cost the
        # whole forward's activations at once: +0.28x a 60M model's weights at create); a
        # freed tensor's id may come back for a new one, which the dead reference tells.
        self.by_id: dict[int, tuple[weakref.ref, TensorInfo]] = {}
        self.next_key = 0
        self.counters: dict[str, int] = {}
        self.suppress = 0
        self.stack: list[str] = []
        self.pending: list[list[TensorInfo]] = []
        self.names = {m: n for n, m in model.named_modules()}
        # tensor key -> the modules whose forward returned it (one tensor), innermost first, and
        # how often each module ran
        self.module_outputs: dict[int, list[str]] = {}
        self.calls: dict[str, int] = {}
        self.params: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.params.setdefault(id(p), n)
        for n, b in model.named_buffers(remove_duplicate=False):
            self.params.setdefault(id(b), n)

    # -- tensors -------------------------------------------------------------------------
    def _new_info(self, t: torch.Tensor, producer: Node | None, index: int) -> TensorInfo:
        info = TensorInfo(self.next_key, tuple(t.shape), t.dtype, producer, index)
        self.next_key += 1
        self.by_id[id(t)] = (weakref.ref(t), info)
        return info

    def known(self, t: torch.Tensor) -> TensorInfo | None:
        entry = self.by_id.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def lookup(self, t: torch.Tensor) -> TensorInfo:
        info = self.known(t)
        if info is None:
            info = self._new_info(t, None, 0)
            info.param_name = self.params.get(id(t))
        return info

    def _convert(self, obj: Any, inputs: list[TensorInfo]) -> Any:
        if isinstance(obj, torch.Tensor):
            inputs.append(self.lookup(obj))
            return TensorArg(len(inputs) - 1)
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._convert(o, inputs) for o in obj) if isinstance(obj, list) else tuple(self._convert(o, inputs) for o in obj)
        if isinstance(obj, dict):
            return {k: self._convert(v, inputs) for k, v in obj.items()}
        return obj

    # -- nodes ---------------------------------------------------------------------------
    def _add_node(self, kind: str, name: str, op: str, inputs: list[TensorInfo], outputs: list[torch.Tensor],
                  args: tuple = (), kwargs: dict | None = None, inplace: bool = False) -> Node:
        node = Node(len(self.nodes), kind, name, op, inputs, [], args, kwargs or {}, inplace,
                    self.stack[-1] if self.stack else "")
        for info in inputs:
            info.consumers.append(node)
        node.outputs = [self._new_info(t, node, i) for i, t in enumerate(outputs)]
        self.nodes.append(node)
        return node

    def add_inputs(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        for t, n in zip(tensors, names):
            self._add_node("input", n, "input", [], [t])

    def add_output(self, tensors: list[torch.Tensor]) -> None:
        self._add_node("output", "output", "output", [self.lookup(t) for t in tensors], [])

    def record_function(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        op, inplace = _op_name(func)
        if op == "setitem":  # x[idx] = y mutates x and returns None
            outs, inplace = [args[0]], True
        else:
            outs = flatten_tensors(out)
        if not outs:
            return
        in_ids = {id(a) for a in flatten_tensors((args, kwargs))}
        # F.relu(x, inplace=True) and the like reach the mode as the functional with a flag
        inplace = inplace or kwargs.get("inplace") is True or op in INPLACE_FLAG and len(args) > 1 and args[1] is True
        if not inplace and all(id(t) in in_ids for t in outs):
            return  # an alias such as .contiguous() on a contiguous tensor: same value, no op
        inputs: list[TensorInfo] = []
        c_args = self._convert(tuple(args), inputs)
        c_kwargs = self._convert(dict(kwargs), inputs)
        n = self.counters.get(op, 0)
        self.counters[op] = n + 1
        self._add_node("function", f"{op}_{n}", op, inputs, outs, c_args, c_kwargs, inplace)

    # -- module hooks --------------------------------------------------------------------
    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.stack.append(self.names.get(module, type(module).__name__))
        if _is_opaque(module):
            if self.suppress == 0:
                inputs: list[TensorInfo] = []
                self._convert((tuple(args), dict(kwargs)), inputs)
                self.pending.append(inputs)
            self.suppress += 1

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = self.stack.pop()
        opaque = _is_opaque(module)
        if self.suppress == int(opaque):  # not inside an opaque module
            self.calls[name] = self.calls.get(name, 0) + 1
            info = self.known(output) if isinstance(output, torch.Tensor) and not opaque else None
            if info is not None:
                self.module_outputs.setdefault(info.key, []).append(name)  # inner hooks run first
        if opaque:
            self.suppress -= 1
            if self.suppress == 0:
                inputs = self.pending.pop()
                in_ids = {id(a) for a in flatten_tensors((args, kwargs))}
                outs = flatten_tensors(output)
                inplace = bool(outs) and all(id(t) in in_ids for t in outs)
                node = self._add_node("module", name, type(module).__name__, inputs, outs, inplace=inplace)
                if isinstance(output, torch.Tensor):
                    self.module_outputs.setdefault(node.outputs[0].key, []).append(name)


class _Recorder(TorchFunctionMode):
    def __init__(self, builder: _Builder) -> None:
        super().__init__()
        self.builder = builder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.builder.suppress == 0:
            self.builder.record_function(func, args, kwargs, out)
        return out


def split_input_data(input_data: Any) -> tuple[tuple, dict]:
    """AMCT's ``input_data``: a tensor, a tuple/list of tensors, or a dict of keyword inputs
    (Hugging Face style); a tuple may end with a dict of keyword inputs as torch.onnx takes it."""
    if isinstance(input_data, torch.Tensor):
        return (input_data,), {}
    if isinstance(input_data, dict):
        return (), dict(input_data)
    if isinstance(input_data, (tuple, list)):
        items = list(input_data)
        if items and isinstance(items[-1], dict):
            return tuple(items[:-1]), dict(items[-1])
        return tuple(items), {}
    raise TypeError(f"input_data must be a torch.Tensor, a tuple/list of tensors or a dict of keyword tensors, got {type(input_data).__name__}")


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def _shallow(v):
    return type(v)(v)


def _refill(obj, saved) -> None:
    """Put ``saved``'s items back into ``obj`` (compared by identity: ``==`` on tensors is
    elementwise)."""
    if isinstance(obj, dict):
        if obj.keys() == saved.keys() and all(obj[k] is saved[k] for k in obj):
            return
        obj.clear()
        obj.update(saved)
    elif isinstance(obj, list):
        if len(obj) == len(saved) and all(a is b for a, b in zip(obj, saved)):
            return
        obj[:] = saved
    else:
        obj.clear()
        obj.update(saved)


@contextlib.contextmanager
def untouched(model: nn.Module):
    """Undo what one forward leaves on the modules: attributes it set or replaced (caches that
    some Hugging Face modules fill in eval mode), buffers it changed (counters), hooks it added.
    The captured model must behave as the one the user handed over."""
    saved = []
    for m in model.modules():
        attrs = {k: v for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules") + _HOOK_DICTS}
        # Containers a forward may fill in place (a cache dict created in __init__): their
        # contents, restored into the same object, which other code may also hold.
        contents = {k: _shallow(v) for k, v in attrs.items() if type(v) in (dict, list, set)}
        buffers = {k: (b, None if b is None else b.detach().clone()) for k, b in m._buffers.items()}
        hooks = {k: dict(getattr(m, k)) for k in _HOOK_DICTS if hasattr(m, k)}
        saved.append((m, attrs, contents, dict(m._parameters), buffers, dict(m._modules), hooks))
    try:
        yield
    finally:
        with torch.no_grad():
            for m, attrs, contents, params, buffers, modules, hooks in saved:
                for k in [k for k in vars(m) if k not in attrs and k not in ("_parameters", "_buffers", "_modules")
                          and k not in _HOOK_DICTS]:
                    delattr(m, k)
                m.__dict__.update(attrs)
                for k, copy_ in contents.items():
                    _refill(attrs[k], copy_)
                m._parameters.clear()
                m._parameters.update(params)
                m._buffers.clear()
                for k, (b, value) in buffers.items():
                    if b is not None and not torch.equal(b, value):
                        b.copy_(value)
                    m._buffers[k] = b
                m._modules.clear()
                m._modules.update(modules)
                for k, d in hooks.items():
                    getattr(m, k).clear()
                    getattr(m, k).update(d)


def capture_graph(model: nn.Module, input_data: Any) -> Graph:
    """Run ``model`` once (eval mode, no grad) and return its dataflow graph.

    The model is left exactly as it was: parameters, buffers, attributes, hooks, train/eval
    flags (see ``untouched``).
    """
    args, kwargs = split_input_data(input_data)
    builder = _Builder(model)
    in_tensors = flatten_tensors((args, kwargs))
    in_names = [f"input_{i}" for i in range(len(flatten_tensors(args)))] + [
        f"{k}" for k, v in kwargs.items() for _ in flatten_tensors(v)]
    builder.add_inputs(in_tensors, in_names)
    handles = []
    with untouched(model):
        out = _run(model, builder, args, kwargs, handles)
    outs = flatten_tensors(out)
    if not outs:
        raise ValueError(f"cannot capture the graph of {type(model).__name__}: its forward returned no tensor")
    builder.add_output(outs)
    graph = Graph(builder.nodes, model)
    graph.module_outputs = _called_once(builder.module_outputs, builder.calls)
    logger.debug("captured %d nodes (%d module calls)", len(graph.nodes), sum(1 for n in graph.nodes if n.kind == "module"))
    return graph


def _called_once(outputs: dict[int, list[str]], calls: dict[str, int]) -> dict[int, str]:
    """Each tensor's innermost producing module that ran once: a forward hook there sees this
    tensor alone. torchvision's Bottleneck calls one ``self.relu`` three times, so its block
    output is named by the Bottleneck, not by the shared ReLU."""
    named = {}
    for key, names in outputs.items():
        once = next((n for n in names if calls.get(n) == 1), None)
        if once is not None:
            named[key] = once
    return named


def _run(model: nn.Module, builder: _Builder, args: tuple, kwargs: dict, handles: list):
    try:
        for m in model.modules():
            handles.append(m.register_forward_pre_hook(builder.pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(builder.post_hook, with_kwargs=True))
        model.eval()
        try:
            with torch.no_grad(), _Recorder(builder):
                out = model(*args, **kwargs)
        except Exception as exc:
            where = builder.stack[-1] if builder.stack else "<top-level forward>"
            mod = dict(model.named_modules()).get(where)
            kind = f" ({type(mod).__name__})" if mod is not None else ""
            raise ValueError(
                f"cannot capture the graph of {type(model).__name__} with the given input_data: "
                f"the forward failed in module {where!r}{kind}: {type(exc).__name__}: {exc}") from exc
    finally:
        for h in handles:
            h.remove()
    return out
