"""Just enough ONNX graph editing for the deploy post-pass (kept apart from the pass itself)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper


class OnnxGraph:
    """Just enough graph editing for the post-pass: producer/user indexes kept up to date,
    constants read as numpy, removal by marking, topological order and dead code on ``finish``."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.g = model.graph
        self.nodes = list(self.g.node)
        self.inits = {t.name: t for t in self.g.initializer}
        self.outputs = {o.name for o in self.g.output}
        self._arrays: dict[str, np.ndarray] = {}
        self._dead: set[int] = set()
        self._names = {o for n in self.nodes for o in n.output} | set(self.inits) | {i.name for i in self.g.input}
        self._prod = {o: n for n in self.nodes for o in n.output}
        self._users: dict[str, list] = defaultdict(list)
        for n in self.nodes:
            for i in n.input:
                self._users[i].append(n)

    def _fresh(self, hint: str) -> str:
        name, k = hint, 0
        while name in self._names:
            k += 1
            name = f"{hint}_{k}"
        self._names.add(name)
        return name

    def attr(self, n, name: str, default=None):
        for a in n.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def producer(self, t: str):
        n = self._prod.get(t)
        return None if n is None or id(n) in self._dead else n

    def users(self, t: str) -> list:
        # unique: set_input may list a node twice under one name (it never un-lists the old one)
        live = {id(n): n for n in self._users.get(t, []) if id(n) not in self._dead}
        return list(live.values())

    def is_output(self, t: str) -> bool:
        return t in self.outputs

    def _const_name(self, t: str) -> str | None:
        p = self.producer(t)
        while p is not None and p.op_type == "Identity":
            t, p = p.input[0], self.producer(p.input[0])
        return t if t in self.inits else None

    def const(self, t: str) -> np.ndarray | None:
        t = self._const_name(t)
        if t is None:
            return None
        if t not in self._arrays:
            self._arrays[t] = numpy_helper.to_array(self.inits[t])
        return self._arrays[t]

    def add_init(self, array: np.ndarray, hint: str) -> str:
        name = self._fresh(hint)
        self.inits[name] = numpy_helper.from_array(np.asarray(array), name)
        return name

    def make(self, op: str, inputs: list[str], **attrs):
        n = helper.make_node(op, inputs, [self._fresh(f"{inputs[0]}_{op}")], **attrs)
        self.nodes.append(n)
        self._prod[n.output[0]] = n
        for i in inputs:
            self._users[i].append(n)
        return n

    def set_input(self, n, i: int, name: str) -> None:
        self._users[name].append(n)
        n.input[i] = name

    def replace_uses(self, old: str, new: str) -> None:
        for u in self.users(old):
            for i, name in enumerate(u.input):
                if name == old:
                    self.set_input(u, i, new)
        if self.is_output(old):  # keep the graph's output name
            n = helper.make_node("Identity", [new], [old])
            self.nodes.append(n)
            self._prod[old] = n
            self._users[new].append(n)

    def remove(self, n) -> None:
        self._dead.add(id(n))

    def insert_qdq(self, t: str, scale: float, zp: int, dtype) -> None:
        users = self.users(t)
        s = self.add_init(np.array(scale, np.float32), f"{t}_scale")
        z = self.add_init(np.array(zp, dtype), f"{t}_zero_point")
        dq = self.make("DequantizeLinear", [self.make("QuantizeLinear", [t, s, z]).output[0], s, z])
        for u in users:
            for i, name in enumerate(u.input):
                if name == t:
                    self.set_input(u, i, dq.output[0])

    def constants_to_initializers(self) -> None:
        for n in self.nodes:
            if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value":
                self.inits[n.output[0]] = numpy_helper.from_array(
                    numpy_helper.to_array(n.attribute[0].t), n.output[0])
                self.remove(n)
        for n in self.nodes:
            if n.op_type == "Identity" and id(n) not in self._dead and n.input[0] in self.inits \
                    and not self.is_output(n.output[0]):
                self.replace_uses(n.output[0], n.input[0])
                self.remove(n)

    # Shape arithmetic the TorchScript exporter leaves on constants (F.pad's pads: Slice ->
    # Transpose -> Reshape -> Cast). ORT drops the Q/DQ around a Pad, so it runs in uint8, only
    # when its pads are an initializer.
    FOLDABLE = ("Cast", "Reshape", "Transpose", "Slice", "Concat", "Unsqueeze", "Squeeze", "Gather",
                "ConstantOfShape")

    def fold_constants(self) -> int:
        """Evaluate FOLDABLE nodes whose inputs are all initializers into initializers."""
        from onnx.reference import ReferenceEvaluator

        folded = 0
        for n in self.topological():
            if n.op_type not in self.FOLDABLE or any(self.is_output(o) for o in n.output):
                continue
            if any(i and self._const_name(i) is None for i in n.input):
                continue  # (checked first: an embedding's Gather would copy the table to numpy)
            args = [self.const(i) if i else None for i in n.input]
            feeds = {i: a for i, a in zip(n.input, args) if i}
            outs = ReferenceEvaluator(n).run(None, feeds)
            for name, value in zip(n.output, outs):
                self.inits[name] = numpy_helper.from_array(np.asarray(value), name)
            self.remove(n)
            folded += 1
        return folded

    def topological(self) -> list:
        live = [n for n in self.nodes if id(n) not in self._dead]
        pending = {id(n): sum(1 for i in n.input if self.producer(i) is not None) for n in live}
        ready = [n for n in live if pending[id(n)] == 0]
        order = []
        while ready:
            n = ready.pop()
            order.append(n)
            for o in n.output:
                for u in self.users(o):
                    reads = sum(1 for i in u.input if i == o)
                    # (a node rewired away from ``o`` by set_input is still listed as its user)
                    if reads and id(u) in pending:
                        pending[id(u)] -= reads
                        if pending[id(u)] == 0:
                            ready.append(u)
        return order

    def finish(self) -> None:
        """Drop what no graph output needs; write nodes (topologically) and initializers back."""
        needed, stack = set(), list(self.outputs)
        while stack:
            p = self.producer(stack.pop())
            if p is not None and id(p) not in needed:
                needed.add(id(p))
                stack.extend(i for i in p.input if i)
        order = [n for n in self.topological() if id(n) in needed]
        used = {i for n in order for i in n.input} | self.outputs
        del self.g.node[:]
        self.g.node.extend(order)
        keep = [t for name, t in self.inits.items() if name in used]
        del self.g.initializer[:]
        self.g.initializer.extend(keep)
