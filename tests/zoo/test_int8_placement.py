"""Issue 14, placement by what ORT fuses: in ONNX Runtime's optimised graph of a zoo CNN's deploy
model, no float op that ORT has an int8 kernel for (Conv, MatMul, Sigmoid, Mul, Add,
GlobalAveragePool) sits between two quantized layers, i.e. reads (through float ops) a
DequantizeLinear and feeds (through float ops) a QuantizeLinear. Such an op costs a DQ/Q round
trip and runs in float where quantize_static's graph stays in int8 (EfficientNet without the
activation quantizers: 65 float Sigmoid + 65 float Mul; MobileNetV2: 9 float residual Adds). Structural, so exact on
every CPU: the optimised graph depends on the ORT version, not on the float sums.
"""

import collections
import importlib

import onnx
import pytest
import torch
from torch import nn

from tests.zoo.families import build, reinitialise
from tests.zoo.lifecycle import int8_deploy_graph

pytestmark = pytest.mark.slow

INT8_KERNEL = {"Conv", "MatMul", "Sigmoid", "Mul", "Add", "GlobalAveragePool", "Concat", "MaxPool"}


def _inception():
    """Three torchvision GoogLeNet blocks, narrow: concats of four branches (in-place ReLUs, a
    max-pool branch reading the tensor the 1x1 convs read), a max pool between blocks. A conv
    reads the last concat: one only an average pool reads stays float (docs/limits.md)."""
    from tests.zoo.torchvision_ops import vision_modules

    vision_modules()
    G = importlib.import_module("torchvision.models.googlenet")  # (torchvision.models.googlenet: the builder)
    model = nn.Sequential(G.BasicConv2d(3, 16, kernel_size=3, padding=1), G.Inception(16, 8, 8, 8, 4, 4, 4),
                          nn.MaxPool2d(3, 2, ceil_mode=True), G.Inception(24, 8, 8, 8, 4, 4, 4),
                          G.Inception(24, 8, 8, 8, 4, 4, 4), G.BasicConv2d(24, 16, kernel_size=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    inputs = {"input": torch.randn(2, 3, 16, 16)}
    reinitialise(model, inputs)
    return model.eval(), inputs


BUILD = {"GoogLeNet-blocks": _inception}


def _optimised(tmp_path, family: str) -> onnx.GraphProto:
    model, inputs = BUILD[family]() if family in BUILD else build(family)
    return int8_deploy_graph(model, inputs, str(tmp_path))


def _float_only(n) -> bool:
    """Ops ORT has no (correct) int8 kernel for, which therefore read float: a ceil_mode
    AveragePool (QLinearAveragePool mis-averages HF EfficientNet's pooler, see deploy._int8_pool).
    The SiLU before that pooler stays float on purpose, so a path through one is not "between
    two quantized layers"."""
    return n.op_type == "AveragePool" and any(a.name == "ceil_mode" and a.i for a in n.attribute)


def _reaches(start, step, target: str) -> bool:
    """Whether walking ``step`` from the nodes in ``start`` through float ops meets ``target``."""
    seen, stack = set(), list(start)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.op_type == target:
            return True
        if not n.op_type.startswith(("QLinear", "QGemm")) and not _float_only(n):  # these end the float path
            stack.extend(step(n))
    return False


@pytest.mark.parametrize("family", ["ResNet", "MobileNetV2", "EfficientNet", "RegNet", "GoogLeNet-blocks"])
def test_no_float_op_between_quantized_layers(tmp_path, family):
    g = _optimised(tmp_path, family)
    prod = {o: n for n in g.node for o in n.output}
    users = collections.defaultdict(list)
    for n in g.node:
        for i in n.input:
            users[i].append(n)

    def up(n):
        return [prod[i] for i in n.input if i in prod]

    def down(n):
        return [u for o in n.output for u in users[o]]

    ops = collections.Counter(n.op_type for n in g.node)
    assert ops["QLinearConv"] > 0, ops  # the check below is not empty
    stuck = [f"{n.op_type} {n.name}" for n in g.node if n.op_type in INT8_KERNEL
             and _reaches(up(n), up, "DequantizeLinear") and _reaches(down(n), down, "QuantizeLinear")]
    assert not stuck, (stuck, dict(ops))
    if family == "GoogLeNet-blocks":  # the block outputs' concats and the max pools run in uint8
        assert ops["QLinearConcat"] == 3 and "Concat" not in ops and "MaxPool" not in ops, dict(ops)
