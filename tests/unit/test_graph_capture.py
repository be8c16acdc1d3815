"""Graph capture finds layers by module path and the ops that connect them."""

import logging
import weakref

import pytest
import torch
from torch import nn

from openamct.graph.capture import _Builder, capture_graph
from openamct.graph.layers import find_layers
from tests.models import MODELS, example_input


def capture(name):
    model = MODELS[name]()
    return model, capture_graph(model, example_input(name))


def producer(graph, module_name, input_pos=0):
    return graph.call_of(module_name).inputs[input_pos].producer


def test_resnet_block_residual_add_joins_stem_and_conv2():
    _, g = capture("ResBlockNet")
    add = next(n for n in g.nodes if n.op == "add")
    sources = {t.producer.name for t in add.inputs}
    assert sources == {"bn2", "stem.2"}  # bn2(conv2(...)) + x, x = stem's ReLU output
    relu = add.outputs[0].consumers[0]
    assert relu.op == "relu" and relu.outputs[0].consumers[0].name == "head"
    assert g.single_bn_after("conv2") == "bn2"


def test_concat_of_two_branches_feeds_conv():
    _, g = capture("ConcatNet")
    cat = producer(g, "conv")
    assert cat.op == "cat" and cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else None) == 1
    assert [t.producer.name for t in cat.inputs] == ["branch1.2", "branch2.2"]


def test_depthwise_separable_chain():
    model, g = capture("DepthwiseSeparableNet")
    assert producer(g, "dw.0").name == "conv.2"
    assert producer(g, "pw").name == "dw.2"
    layers = find_layers(model, g)
    assert layers["dw.0"].depthwise and not layers["conv.0"].depthwise


def test_conv_global_pool_flatten_linear():
    _, g = capture("PoolFlattenLinearNet")
    chain, node = [], g.call_of("fc")
    while node.inputs and node.inputs[0].producer is not None:
        node = node.inputs[0].producer
        chain.append(node.op)
    assert chain == ["Flatten", "AdaptiveAvgPool2d", "ReLU", "Conv2d", "input"]
    assert g.fed_by_relu("fc")


def test_transformer_block_qkv_and_residuals():
    model, g = capture("TinyTransformerBlock")
    for name in ("q_proj", "k_proj", "v_proj"):
        assert producer(g, name).name == "ln1"
        users = g.call_of(name).outputs[0].consumers
        assert [u.op for u in users] == ["reshape"]
    assert producer(g, "out_proj").op == "reshape"
    assert producer(g, "fc2").name == "act" and producer(g, "fc1").name == "ln2"
    adds = [n for n in g.nodes if n.op == "add"]
    assert len(adds) == 2
    assert any(t.producer is not None and t.producer.name == "fc2" for t in adds[1].inputs)
    assert [t.producer.op for t in g.outputs] == ["add"]
    assert set(find_layers(model, g)) == {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}


def test_reused_and_shared_layers_are_excluded_with_warning(caplog):
    caplog.set_level(logging.WARNING)
    model, g = capture("ReusedModuleNet")
    layers = find_layers(model, g)
    assert "called 2 times" in layers["shared"].excluded and layers["stem"].excluded is None
    model, g = capture("SharedWeightNet")
    layers = find_layers(model, g)
    assert layers["fc1"].excluded and layers["fc2"].excluded
    assert "shares its parameters" in caplog.text


def test_data_dependent_control_flow_is_captured_as_run():
    # torch.fx cannot trace this model; executing it records the branch the input took.
    model = MODELS["UntraceableNet"]()
    g = capture_graph(model, torch.ones(1, 3, 16, 16))
    assert "conv_pos" in g.module_calls and "conv_neg" not in g.module_calls
    layers = find_layers(model, g)
    assert "never called" in layers["conv_neg"].excluded


def test_capture_failure_names_the_module():
    model = MODELS["Net001"]()
    with pytest.raises(ValueError, match=r"forward failed in module 'layer1.0' \(Conv2d\): RuntimeError: .*"
                                         r"to have 2 channels, but got 3"):
        capture_graph(model, torch.randn(1, 3, 28, 28))  # wrong channel count: the why is torch's own

    class NoTensorOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return {"label": "cat", "score": float(self.conv(x).mean())}

    with pytest.raises(ValueError, match="NoTensorOut: its forward returned no tensor"):
        capture_graph(NoTensorOut(), torch.randn(1, 3, 8, 8))


def test_capture_leaves_model_untouched():
    model = MODELS["Net001"]()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    capture_graph(model, example_input("Net001"))
    assert model.training and all(m.training for m in model.modules())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_inplace_ops_and_keyword_inputs():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x, mask=None):
            y = self.a(x)
            y += mask
            return self.b(torch.relu_(y))

    g = capture_graph(KW(), {"x": torch.randn(2, 4), "mask": torch.randn(2, 4)})
    relu = producer(g, "b")
    assert relu.op == "relu" and relu.inplace
    add = relu.inputs[0].producer
    assert add.op == "add" and add.inplace and add.inputs[0].producer.name == "a"
    assert g.fed_by_relu("b")


def test_capture_frees_each_activation_once_read():
    """The capture holds what a forward holds: an activation is freed once its readers ran, not
    kept to the end (holding the whole forward's activations at once cost +0.28x a 60M model's
    weights at create)."""
    freed_before_return: list[int] = []  # outside the model: capture undoes what forward sets on it

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            freed = []
            h = self.a(x)
            for i in range(3):
                y = h * 2
                weakref.finalize(y, freed.append, i)
                h = y + 1
                del y
            freed_before_return.extend(freed)
            return self.b(h)

    g = capture_graph(Chain(), torch.randn(2, 8))
    assert freed_before_return == [0, 1, 2]
    # and the graph is whole: b reads a's output through the three mul/add pairs
    node, ops = g.call_of("b").inputs[0].producer, []
    while node.kind == "function":
        ops.append(node.op)
        node = node.inputs[0].producer
    assert ops == ["add", "mul"] * 3 and node.name == "a"


def test_a_new_tensor_at_a_freed_tensors_id_is_a_new_value():
    builder = _Builder(nn.Linear(2, 2))
    old, new = torch.zeros(3), torch.ones(3)
    old_info = builder.lookup(old)
    builder.by_id[id(new)] = builder.by_id.pop(id(old))  # as if ``new`` took ``old``'s address
    assert builder.known(new) is None and builder.lookup(new) is not old_info
    assert builder.lookup(new) is builder.lookup(new)
