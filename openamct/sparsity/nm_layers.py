"""Which layers 2:4 sparsity applies to, and along which weight axis its groups of 4 run:
the input-channel axis (1 for Conv1d/2d/3d and Linear, 0 for ConvTranspose, whose groups
also concatenate along it)."""

from __future__ import annotations

from torch import Tensor, nn

from openamct.layer_types import CONVS, NM_TYPES, TRANSPOSED_CONVS, layer_type_of

__all__ = ["nm_axis", "nm_groups", "nm_eligible"]

# Classes whose weight layout is [Cin, Cout/groups, ...]; every other conv and Linear is
# [Cout, Cin/groups, ...].
_TRANSPOSED = TRANSPOSED_CONVS
_REGULAR = (*CONVS, nn.Linear)
_KIND_AXIS = {cls.__name__: 0 for cls in _TRANSPOSED} | {cls.__name__: 1 for cls in _REGULAR}


def nm_axis(module_or_kind: nn.Module | type | str) -> int:
    """Input-channel axis of the weight: 1 for Conv1d/2d/3d and Linear, 0 for ConvTranspose.

    Accepts a module instance, a module class or a class name such as ``"Conv2d"``.
    """
    if isinstance(module_or_kind, str):
        if module_or_kind not in _KIND_AXIS:
            raise ValueError(
                f"module_or_kind: unknown layer kind {module_or_kind!r}; "
                f"expected one of {sorted(_KIND_AXIS)}"
            )
        return _KIND_AXIS[module_or_kind]
    cls = module_or_kind if isinstance(module_or_kind, type) else type(module_or_kind)
    row = layer_type_of(module_or_kind) if isinstance(module_or_kind, nn.Module) else None
    if row is not None:
        return row.in_axis
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(
            f"module_or_kind: expected an nn.Module, a module class or a kind name, "
            f"got {type(module_or_kind).__name__}"
        )
    # Transposed first: ConvTranspose*d and Conv*d share the _ConvNd base.
    if issubclass(cls, _TRANSPOSED):
        return 0
    if issubclass(cls, _REGULAR):
        return 1
    raise ValueError(f"module_or_kind: {cls.__name__} has no known input-channel axis")


def nm_groups(module: nn.Module) -> int:
    """How many independent channel groups share the weight's input-channel axis.

    Only transposed convs concatenate their groups along that axis (weight [Cin, Cout/g, ...]);
    an N:M group must not straddle two conv groups, so the mask pads each group separately.
    """
    if isinstance(module, _TRANSPOSED):
        return int(module.groups)
    return 1


def nm_eligible(module: nn.Module) -> tuple[bool, str]:
    """Whether 2:4 applies to ``module``, and why not (a message callers log) when it does not."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
    kind = type(module).__name__
    row = layer_type_of(module)
    if row is None or not row.nm:
        return False, f"{kind} is not supported by 2:4 sparsity ({', '.join(NM_TYPES)})"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or isinstance(weight, nn.parameter.UninitializedParameter):
        return False, f"{kind} has no initialised weight"
    if not weight.is_floating_point():
        return False, f"{kind} weight has non-float dtype {weight.dtype}"
    axis = nm_axis(module)
    per_group = weight.shape[axis] // nm_groups(module)
    if per_group <= 2:
        return False, (
            f"{kind} has {per_group} input channel(s) per group (<= 2, e.g. depthwise): kept dense"
        )
    return True, ""
