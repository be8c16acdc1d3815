"""Which ops the channel-dependency analysis passes through, couples on, or ignores, by name
(module class names and ``torch``/``Tensor`` function names as the graph capture records them),
and the small node and tensor helpers its error messages and argument reading share.
"""

from __future__ import annotations

from openamct.graph.node import Node, TensorInfo
from openamct.layer_types import LAYER_TYPES

__all__ = ["BATCHNORMS", "BINARY_FUNCTIONS", "CONSUMER_TYPES", "NO_CHANNELS", "PRODUCER_OP", "UNARY_FUNCTIONS",
           "UNARY_MODULES", "describe", "node_arg", "origin"]
_POOL = {f"{p}{d}d" for p in ("MaxPool", "AvgPool", "AdaptiveAvgPool", "AdaptiveMaxPool", "LPPool") for d in (1, 2, 3)}
_PAD = {f"{p}{d}d" for p in ("ZeroPad", "ConstantPad", "ReflectionPad", "ReplicationPad", "CircularPad") for d in (1, 2, 3)}
UNARY_MODULES = _POOL | _PAD | {
    "ReLU", "ReLU6", "LeakyReLU", "GELU", "SiLU", "Sigmoid", "Tanh", "Hardswish", "Hardsigmoid", "Hardtanh",
    "ELU", "SELU", "CELU", "Mish", "Softplus", "Softsign", "Tanhshrink", "Threshold", "Identity", "Dropout",
    "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout", "Upsample",
    "UpsamplingNearest2d", "UpsamplingBilinear2d"}
UNARY_FUNCTIONS = {
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "lp_pool1d",
    "lp_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d",
    "relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "hardtanh", "leaky_relu",
    "elu", "selu", "celu", "mish", "softplus", "softsign", "threshold", "dropout", "dropout1d", "dropout2d",
    "dropout3d", "alpha_dropout", "feature_alpha_dropout", "clamp", "clip", "clamp_min", "clamp_max", "neg",
    "abs", "exp", "log", "sqrt", "rsqrt", "square", "erf", "reciprocal", "sign", "floor", "ceil", "round",
    "contiguous", "clone", "detach", "to", "float", "half", "double", "bfloat16", "type", "type_as",
    "max_pool2d_with_indices", "pad", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
    "expand", "repeat"}
BINARY_FUNCTIONS = {"add": "Add", "sub": "Sub", "rsub": "Sub", "mul": "Mul", "div": "Div", "true_divide": "Div",
                    "floor_divide": None, "maximum": None, "minimum": None, "pow": None, "where": None,
                    "remainder": None, "fmod": None, "expand_as": None}
NO_CHANNELS = {"new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
               "full_like", "rand_like", "randn_like", "size", "dim", "numel"}
BATCHNORMS = {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d"}
CONSUMER_TYPES = {n: t.op_type for n, t in LAYER_TYPES.items() if t.filter}
PRODUCER_OP = {n: t.op_type for n, t in LAYER_TYPES.items() if not t.recurrent}  # groups end at an LSTM/GRU


def node_arg(node: Node, pos: int, key: str, default: object = None) -> object:
    """A call's argument, given by position ``pos`` or as keyword ``key``."""
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(key, default)


def origin(t: TensorInfo) -> TensorInfo:
    """Back through dropout, activations and other one-input pass-through ops to the op that
    really made the values (an embedding's add, a LayerNorm, a graph input)."""
    while t.producer is not None and t.producer.inputs and (
            (t.producer.kind == "module" and t.producer.op in UNARY_MODULES)
            or (t.producer.kind == "function" and t.producer.op in UNARY_FUNCTIONS)):
        t = t.producer.inputs[0]
    return t


def describe(t: TensorInfo) -> str:
    """Where ``t`` came from, as an error message names it."""
    if t.producer is None:
        return f"parameter {t.param_name!r}" if t.param_name else "a constant"
    if t.producer.kind == "input":
        return f"graph input {t.producer.name!r}"
    return f"the output of {t.producer.name} ({t.producer.op})"
