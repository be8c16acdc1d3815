"""Quantizers on both inputs of the activation x activation matrix products inside a module's
forward: attention's ``q @ k^T`` and ``softmax(...) @ v``.

Why: ONNX Runtime runs a MatMul as an integer kernel (QLinearMatMul, or MatMulIntegerToFloat
when its output stays float) only when both inputs are DequantizeLinear outputs; left float,
attention's two products are the bulk of the float work in a quantized transformer
(torchvision Swin-T: 24 float MatMuls beside the int8 Linears). ``quantize_static`` quantizes
them from calibration ranges; here each input has a trained ULQ clip, so the fake-quant model
computes what the deploy model does.

How: the products are torch function calls (``q.matmul(k)``, ``a @ b``, ``torch.bmm``), not
modules, so no module can be swapped in for them. The owning module (an attention block) gets a
``MatMulQuant`` child holding one pair of quantizers per product, and a forward pre-hook / hook
pair (``MatMulHooks``, the post hook always called, also when the forward raises) that runs its
forward under a ``TorchFunctionMode``. The mode counts the matrix-product calls of one forward
in order and, for the counted positions the graph capture found (``sites``), calls the
function on the quantized inputs. Export swaps the quantizers for FakeQuantAct / QDQAct
(``swap_matmul_quantizers``); the ONNX exporter traces the same mode, so the MatMul reads
Q -> DQ of each input in the deploy model.

The hooks are objects, not closures, so a deep copy of the model (the export's working copy)
points them at the copied ``MatMulQuant``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["MATMUL_OPS", "MatMulHooks", "MatMulQuant", "ModeHooks", "attach", "hook_mode", "matmul_quants",
           "module_of_caller", "swap_matmul_quantizers"]

# The functions a matrix product of two tensors reaches __torch_function__ as, and the op name
# graph capture records them under (``graph.capture._op_name``).
MATMUL_FUNCTIONS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)
MATMUL_OPS = ("matmul", "bmm")
CHILD = "matmul_quant"  # the attribute name of the MatMulQuant child on the owning module


class MatMulQuant(nn.Module):
    """The quantizers of one module's products: ``q_a[i]``, ``q_b[i]`` on the inputs of the
    product at position ``sites[i]`` among the module's matrix-product calls in one forward."""

    def __init__(self, sites: Sequence[int], q_a: Sequence[nn.Module], q_b: Sequence[nn.Module]) -> None:
        super().__init__()
        if not len(sites) == len(q_a) == len(q_b):
            raise ValueError(f"sites, q_a, q_b: expected equal lengths, got {len(sites)}, {len(q_a)}, {len(q_b)}")
        self.sites = tuple(int(s) for s in sites)
        self.q_a, self.q_b = nn.ModuleList(q_a), nn.ModuleList(q_b)

    def quantizers(self) -> dict[str, nn.Module]:
        """``a<i>`` / ``b<i>`` -> quantizer, in site order (the record's names)."""
        out = {}
        for i, (a, b) in enumerate(zip(self.q_a, self.q_b)):
            out[f"a{i}"], out[f"b{i}"] = a, b
        return out

    def with_quantizers(self, make: Callable[[float, int], nn.Module]) -> MatMulQuant:
        """A copy whose quantizers are ``make(scale, offset)`` of each trained one (export)."""
        return MatMulQuant(self.sites, [make(*q.scale_offset()) for q in self.q_a],
                           [make(*q.scale_offset()) for q in self.q_b])

    def forward(self, x: Tensor) -> Tensor:  # not called: the hooks apply the quantizers
        raise RuntimeError("MatMulQuant is applied by MatMulHooks around its owner's forward")

    def extra_repr(self) -> str:
        return f"sites={list(self.sites)}"


def module_of_caller(depth: int = 64) -> nn.Module | None:
    """The innermost module whose code (its forward, or a plain function it calls) is running:
    the ``self`` of the nearest calling frame that has a module as ``self``. Call it directly
    from a ``__torch_function__``: frame 2 is the code that called the torch function."""
    frame = sys._getframe(2)
    while frame is not None and depth > 0:
        if "self" in frame.f_code.co_varnames[:1]:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module):
                return owner
        frame, depth = frame.f_back, depth - 1
    return None


class _Mode(TorchFunctionMode):
    """Counts the matrix products the owner's own code calls (graph capture gives these the
    owner as scope); a product inside a child module's forward (a layer's export form computes
    ``x @ w``) is not the owner's and is not counted."""

    def __init__(self, owner: nn.Module, quant: MatMulQuant) -> None:
        super().__init__()
        self.owner, self.quant = owner, quant
        self.count = 0
        self.slot = {s: i for i, s in enumerate(quant.sites)}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in MATMUL_FUNCTIONS and len(args) == 2 and all(isinstance(a, Tensor) for a in args) \
                and module_of_caller() is self.owner:
            i = self.slot.get(self.count)
            self.count += 1
            if i is not None:  # (this mode is off while its own __torch_function__ runs)
                args = (self.quant.q_a[i](args[0]), self.quant.q_b[i](args[1]))
        return func(*args, **kwargs)


class ModeHooks:
    """Forward pre-hook and hook of an owning module: enter / leave ``make(module)``, a
    ``TorchFunctionMode``, around its forward. One forward at a time per module (a nested call
    of the same module would count its calls into the outer forward's). ``make`` must be a plain
    function or a ``functools.partial`` of immutable arguments: a deep copy of the model shares it."""

    def __init__(self, make: Callable[[nn.Module], TorchFunctionMode]) -> None:
        self.make = make
        self.active: list[TorchFunctionMode] = []

    def pre(self, module: nn.Module, args: tuple) -> None:
        mode = self.make(module)
        mode.__enter__()
        self.active.append(mode)

    def post(self, module: nn.Module, args: tuple, output):
        if self.active:
            self.active.pop().__exit__(None, None, None)
        return None

    def __deepcopy__(self, memo) -> ModeHooks:
        return ModeHooks(self.make)  # a mode of this forward is never copied


def _matmul_mode(module: nn.Module) -> _Mode:
    return _Mode(module, getattr(module, CHILD))


class MatMulHooks(ModeHooks):
    """``ModeHooks`` entering a ``_Mode`` over the owner's ``MatMulQuant`` child."""

    def __init__(self) -> None:
        super().__init__(_matmul_mode)

    def __deepcopy__(self, memo) -> MatMulHooks:
        return MatMulHooks()


def hook_mode(module: nn.Module, hooks: ModeHooks) -> None:
    """Register ``hooks`` on ``module``. The post hook is prepended, so modes of several hook
    pairs on one module leave in the reverse order they entered; it is always called, also when
    the forward raises."""
    module.register_forward_pre_hook(hooks.pre)
    module.register_forward_hook(hooks.post, always_call=True, prepend=True)


def attach(module: nn.Module, quant: MatMulQuant) -> None:
    """Give ``module`` its quantizers (child ``matmul_quant``) and the hooks that apply them."""
    if hasattr(module, CHILD):
        raise ValueError(f"{type(module).__name__} already has an attribute {CHILD!r}")
    module.add_module(CHILD, quant)
    hook_mode(module, MatMulHooks())


def matmul_quants(model: nn.Module) -> list[tuple[str, MatMulQuant]]:
    """(owning module path, its MatMulQuant) for every module ``attach`` gave quantizers."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MatMulQuant)]


def swap_matmul_quantizers(model: nn.Module, make: Callable[[float, int], nn.Module]) -> int:
    """Export: each MatMulQuant of ``model`` (a working copy) gets ``make(scale, offset)`` of its
    trained quantizers (FakeQuantAct or QDQAct); returns how many modules."""
    found = matmul_quants(model)
    for name, m in found:
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(owner, CHILD, m.with_quantizers(make).eval())
    return len(found)
