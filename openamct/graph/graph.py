"""A captured dataflow graph and the queries the techniques ask of it."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from openamct.graph.node import Node, TensorInfo

# Ops that leave values element-for-element in place, so a channel decision passes through
# and non-negativity (a ReLU's output) is kept.
SIGN_PRESERVING_MODULES = {"MaxPool1d", "MaxPool2d", "MaxPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d",
                           "AdaptiveMaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d",
                           "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "Flatten", "Identity", "Dropout",
                           "Dropout1d", "Dropout2d", "Dropout3d"}
SIGN_PRESERVING_FUNCTIONS = {"max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
                             "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
                             "adaptive_max_pool2d", "flatten", "view", "reshape", "contiguous", "dropout",
                             "max_pool2d_with_indices"}
RELU_MODULES = {"ReLU", "ReLU6"}
RELU_FUNCTIONS = {"relu", "relu6"}


class Graph:
    def __init__(self, nodes: list[Node], model: nn.Module) -> None:
        self.nodes = nodes
        self.module_calls: dict[str, list[Node]] = {}
        for node in nodes:
            if node.kind == "module":
                self.module_calls.setdefault(node.name, []).append(node)
        self.inputs = [n.outputs[0] for n in nodes if n.kind == "input"]
        out_nodes = [n for n in nodes if n.kind == "output"]
        self.outputs: list[TensorInfo] = out_nodes[0].inputs if out_nodes else []
        self.model_type = type(model).__name__
        # tensor key -> the innermost module called once whose forward returned exactly that
        # tensor (capture fills it): where a hook can quantize a tensor no layer produces
        self.module_outputs: dict[int, str] = {}
        # layer name -> the F.linear call that computes it for an owner that never calls the
        # layer (graph.layers.functional_linear fills it): that layer's call
        self.functional_calls: dict[str, Node] = {}

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def call_of(self, module_name: str) -> Node | None:
        """The node of a module called exactly once (or of its functional F.linear call), else None."""
        calls = self.module_calls.get(module_name, [])
        if not calls and module_name in self.functional_calls:
            return self.functional_calls[module_name]
        return calls[0] if len(calls) == 1 else None

    def is_output(self, tensor: TensorInfo) -> bool:
        return any(t is tensor for t in self.outputs)

    @staticmethod
    def users(tensor: TensorInfo) -> list[Node]:
        return [n for n in tensor.consumers if n.kind != "output"]

    def single_bn_after(self, module_name: str) -> str | None:
        """Name of the BatchNorm that is the only consumer of this layer's output (foldable)."""
        node = self.call_of(module_name)
        if node is None or len(node.outputs) != 1:
            return None
        out = node.outputs[0]
        if self.is_output(out) or len(out.consumers) != 1:
            return None
        bn = out.consumers[0]
        if bn.kind != "module" or not bn.op.startswith("BatchNorm") or len(self.module_calls.get(bn.name, [])) != 1:
            return None
        return bn.name

    def fed_by_relu(self, module_name: str) -> bool:
        """True when the layer's input is a ReLU output, possibly through pooling/reshaping
        ops that keep values non-negative, or a concat of such outputs (so the activation
        clip_min can be pinned at 0)."""
        node = self.call_of(module_name)
        return node is not None and bool(node.inputs) and _relu_fed(node.inputs[0])

    def input_tensor(self, module_name: str) -> TensorInfo | None:
        node = self.call_of(module_name)
        return node.inputs[0] if node is not None and node.inputs else None

    def describe(self) -> str:
        lines = []
        for n in self.nodes:
            ins = ", ".join(repr(t) for t in n.inputs)
            lines.append(f"{n.idx:4d} {n.kind:8s} {n.name:30s} {n.op:20s} <- {ins}")
        return "\n".join(lines)


def _relu_fed(t: TensorInfo) -> bool:
    producer = t.producer
    while producer is not None:
        if (producer.kind == "module" and producer.op in RELU_MODULES) or (
                producer.kind == "function" and producer.op in RELU_FUNCTIONS):
            return True
        if producer.kind == "function" and producer.op == "cat":
            return bool(producer.inputs) and all(_relu_fed(i) for i in producer.inputs)
        keeps_sign = (producer.kind == "module" and producer.op in SIGN_PRESERVING_MODULES) or (
            producer.kind == "function" and producer.op in SIGN_PRESERVING_FUNCTIONS)
        if not keeps_sign or not producer.inputs:
            return False
        producer = producer.inputs[0].producer
    return False
