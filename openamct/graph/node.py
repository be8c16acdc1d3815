"""The two things a captured graph is made of: tensors and the calls that produce them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class TensorInfo:
    """One value flowing through the model (an in-place op yields a new TensorInfo)."""

    key: int
    shape: tuple[int, ...]
    dtype: Any
    producer: Node | None = None  # None: graph input, parameter, buffer or constant
    index: int = 0  # output position in the producer
    consumers: list[Node] = field(default_factory=list)
    param_name: str | None = None  # set when the tensor is a parameter/buffer of the model

    def __repr__(self) -> str:
        src = self.producer.name if self.producer is not None else (self.param_name or "const")
        return f"T{self.key}<{src}:{list(self.shape)}>"


@dataclass(eq=False)
class Node:
    """One call: a module treated as a single op, a torch function, a graph input or output.

    ``args``/``kwargs`` hold the call's non-tensor arguments; tensor arguments appear there
    as ``TensorArg(i)`` markers pointing into ``inputs``.
    """

    idx: int
    kind: str  # "input" | "module" | "function" | "output"
    name: str  # module path for modules ("layer1.0"); unique "<op>_<n>" for functions
    op: str  # module class name ("Conv2d") or normalised function name ("add", "cat")
    inputs: list[TensorInfo] = field(default_factory=list)
    outputs: list[TensorInfo] = field(default_factory=list)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    inplace: bool = False
    scope: str = ""  # the innermost enclosing module, for messages

    def __repr__(self) -> str:
        return f"Node({self.kind}:{self.name}:{self.op})"


@dataclass(frozen=True)
class TensorArg:
    """Placeholder for a tensor argument inside Node.args / Node.kwargs."""

    pos: int
