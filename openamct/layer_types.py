"""The one table of the layer types openamct compresses and their geometry.

Configs name layer types by their torch class name ("Conv2d"); a subclass counts as its base
(MultiheadAttention's out_proj is a Linear). Graph layer discovery, the compressed layer, 2:4
masks and channel-dependency analysis read the geometry here (op_type, spatial, transposed,
axes). Which layers a technique may touch is the technique's own declaration
(``Technique.layer_types`` / ``eligible``); the ``nm`` and ``filter`` columns remain for the
2:4 kernels (``sparsity/nm.py``) and the channel-dependency analysis (``sparsity/dependency.py``),
which the 2:4 and filter-pruning techniques check against (tests/unit/test_technique_protocol.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LayerType:
    name: str  # the config spelling: the torch class name
    cls: type[nn.Module] | None  # None: matched by class name in a package (not imported here)
    op_type: str  # the ONNX op it exports as (record files name members by it)
    spatial: int  # 0 for Linear
    transposed: bool  # weight [Cin, Cout/groups, ...] instead of [Cout, Cin/groups, ...]
    nm: bool  # 2:4 sparsity
    filter: str  # "active": pruned on its own; "consumer": follows its input only; "": neither

    @property
    def in_axis(self) -> int:
        """The weight's input-channel axis (2:4 groups run along it)."""
        return 0 if self.transposed else 1

    @property
    def out_axis(self) -> int:
        return 1 if self.transposed else 0

    @property
    def matrix(self) -> bool:
        """A matrix layer (Linear-like: features on the last axis of its input)."""
        return self.spatial == 0 and not self.recurrent

    def matches(self, cls: type) -> bool:
        if self.cls is not None:
            return issubclass(cls, self.cls)
        return any(c.__name__ == self.name and c.__module__.startswith(self.package) for c in cls.__mro__)

    package: str = ""  # where a class matched by name lives
    # An LSTM/GRU: quantized only (``compressed.recurrent``); channel pruning and 2:4 never
    # touch it, and pruning groups end at it.
    recurrent: bool = False


LAYER_TYPES: dict[str, LayerType] = {t.name: t for t in (
    LayerType("Conv1d", nn.Conv1d, "Conv", 1, False, nm=False, filter="active"),
    LayerType("Conv2d", nn.Conv2d, "Conv", 2, False, nm=True, filter="active"),
    LayerType("Conv3d", nn.Conv3d, "Conv", 3, False, nm=False, filter=""),
    LayerType("ConvTranspose1d", nn.ConvTranspose1d, "ConvTranspose", 1, True, nm=False,
              filter="consumer"),
    LayerType("ConvTranspose2d", nn.ConvTranspose2d, "ConvTranspose", 2, True, nm=True,
              filter="consumer"),
    LayerType("Linear", nn.Linear, "Gemm", 0, False, nm=True, filter="active"),
    # Hugging Face's GPT-2 style projection: a Linear whose weight is stored [in, out].
    LayerType("Conv1D", None, "Gemm", 0, True, nm=True, filter="active", package="transformers"),
    LayerType("LSTM", nn.LSTM, "LSTM", 0, False, nm=False, filter="", recurrent=True),
    LayerType("GRU", nn.GRU, "GRU", 0, False, nm=False, filter="", recurrent=True),
)}

NM_TYPES = tuple(n for n, t in LAYER_TYPES.items() if t.nm)
FILTER_TYPES = tuple(n for n, t in LAYER_TYPES.items() if t.filter == "active")
ALL_TYPES = tuple(LAYER_TYPES)
RECURRENT_TYPES = tuple(n for n, t in LAYER_TYPES.items() if t.recurrent)

# Modules channel pruning slices along with a layer but never decides for (BatchNorm follows its conv).
BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def layer_type_of(module: nn.Module) -> LayerType | None:
    """The table row of ``module`` (exact class first, then the first base class), or None."""
    cls = getattr(type(module), "_layer_cls", type(module))  # a compressed layer: what it was
    exact = LAYER_TYPES.get(cls.__name__)
    if exact is not None and (cls is exact.cls or (exact.cls is None and exact.matches(cls))):
        return exact
    for t in LAYER_TYPES.values():
        if t.matches(cls):
            return t
    return None


def unsupported_recurrent(module: nn.Module) -> str | None:
    """Why an LSTM/GRU cannot be compressed at all (it stays float), or None."""
    if getattr(module, "proj_size", 0):
        return f"LSTM with proj_size={module.proj_size} (a projected hidden state) is not supported"
    return None


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a matrix layer (Linear or Conv1D)."""
    row = layer_type_of(module)
    w = module.weight
    return int(w.shape[row.in_axis]), int(w.shape[row.out_axis])


def is_depthwise(module: nn.Module) -> bool:
    """A conv whose every group reads one input channel (it follows its input's channels)."""
    return (isinstance(module, CONVS) and module.groups > 1 and module.groups == module.in_channels)
