"""Per-channel parameter owners: modules and bare parameters that hold one value per channel of
a pruned axis (LayerNorm/RMSNorm/GroupNorm over the channels, ConvNeXt's channels-first/last
LayerNorm, ConvNeXtV2's GRN, LayerScale vectors). They follow a filter-prune decision: their
vectors are sliced with the channels instead of stopping the group.

Why slicing is allowed although a norm mixes the channels it normalises: the pruned model is
retrained, and a norm over the kept channels is what the smaller model computes (the same
trade Torch-Pruning makes); the per-position parameters themselves are exact.

The rule for what is per-channel is read off the module alone, so restore (which has no graph
axis) slices exactly what create sliced: every parameter/buffer with more than one element has
one dimension of size C and size 1 everywhere else, and that dimension is sliced.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Record types (ONNX-style names) of the owners; "Parameter" is a bare nn.Parameter used in an
# element-wise op (LayerScale's ``gamma * x``), named by its full parameter path.
LAYER_NORM, RMS_NORM, GROUP_NORM, CHANNEL_PARAMS, PARAMETER = (
    "LayerNormalization", "RMSNormalization", "GroupNormalization", "ChannelParams", "Parameter")
# An int attribute the forward reshapes with (an attention module's ``all_head_size``), named
# "<module path>.<attribute>": it becomes the kept count.
ATTRIBUTE = "Attribute"
# A module that owns only one-element tensors and works on each channel alone: it passes the
# channels on and has nothing to slice (no record entry).
SCALARS = ""
SIZE_ATTRS = ("all_head_size", "inner_dim", "head_size_total", "attn_dim")
OWNER_TYPES = (LAYER_NORM, RMS_NORM, GROUP_NORM, CHANNEL_PARAMS, PARAMETER, ATTRIBUTE)
_RMS_NORM = getattr(nn, "RMSNorm", ())


@dataclass(frozen=True)
class Owner:
    op_type: str  # one of OWNER_TYPES
    fold: int = 1  # removal must be equal within this many contiguous channel blocks (GroupNorm)


def vector_dim(t: torch.Tensor) -> int | None:
    """The one dimension of size > 1 of a per-channel vector ((C,), (1, 1, 1, C), ...), or None."""
    big = [d for d, n in enumerate(t.shape) if n > 1]
    return big[0] if len(big) == 1 else None


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
            if t is not None and t.numel() > 1}


def _channelwise(m: nn.Module, in_shape: tuple[int, ...], axis: int) -> bool:
    """Does ``m`` compute each channel of ``axis`` from that channel alone, with its per-channel
    tensors sliced as ``sliced`` slices them? For modules whose forward is their own code and
    whose tensors do not say it by their shape: HGNetV2's ``LearnableAffineBlock`` (only scalars:
    ``scale * x + bias``), EfficientFormerV2's ``LayerScale2d`` (a ``(C,)`` gamma it views to
    ``(1, C, 1, 1)``). It is run on a random input of that shape, and a copy that keeps every other
    channel on those channels; the two outputs must agree there."""
    tensors = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
    if not tensors or in_shape[axis] < 2 or any(t.device.type == "meta" for t in tensors):
        return False
    g = torch.Generator(device=tensors[0].device).manual_seed(0)
    x = torch.randn(in_shape, generator=g, device=tensors[0].device, dtype=tensors[0].dtype)
    keep = list(range(0, in_shape[axis], 2))
    index = torch.tensor(keep, device=x.device)
    small = copy.deepcopy(m)
    new, ints = sliced(small, keep)
    for attr, t in new.items():
        if attr in small._parameters:
            small._parameters[attr] = nn.Parameter(t, requires_grad=False)
        else:
            small._buffers[attr] = t
    for attr, value in ints.items():
        setattr(small, attr, value)
    try:
        with torch.no_grad():
            whole, part = m(x), small(x.index_select(axis, index))
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False
    return (isinstance(whole, torch.Tensor) and isinstance(part, torch.Tensor) and whole.shape == x.shape
            and part.shape == whole.index_select(axis, index).shape
            and torch.allclose(whole.index_select(axis, index), part, atol=1e-6))


def _generic(name: str, m: nn.Module, in_shape: tuple[int, ...], axis: int) -> Owner | str:
    """A module with no known type: per-channel if every tensor it owns lines up with the
    channel axis under broadcasting (a (1, 1, 1, C) GRN weight on an (N, H, W, C) input)."""
    state = _state(m)
    if not state:
        if _channelwise(m, in_shape, axis):
            return Owner(SCALARS)
        return f"module {name!r} ({type(m).__name__}) uses the channels in a way filter pruning cannot follow"
    if owner_size(m) == in_shape[axis] and _channelwise(m, in_shape, axis):
        return Owner(CHANNEL_PARAMS)
    for attr, t in state.items():
        d = vector_dim(t)
        if d is None or t.dim() > len(in_shape) or d - t.dim() != axis - len(in_shape):
            return (f"module {name!r} ({type(m).__name__}): its {attr!r} {tuple(t.shape)} is not one value per "
                    f"channel of the pruned axis {axis} of its input {tuple(in_shape)}")
        if t.shape[d] != in_shape[axis]:
            return f"module {name!r}: its {attr!r} has {t.shape[d]} values, the channel axis {in_shape[axis]}"
    return Owner(CHANNEL_PARAMS)


def _channels_first(m: nn.Module, in_shape: tuple[int, ...]) -> bool:
    """Does LayerNorm subclass ``m`` normalise axis 1 of an ``in_shape`` input (timm's and
    torchvision's ``LayerNorm2d``: permute to channels-last, ``F.layer_norm``, permute back)?
    Its forward is its own code, so it is run once on a random input of that shape and compared
    with a layer norm over axis 1."""
    if type(m).forward is nn.LayerNorm.forward or len(in_shape) < 3 or tuple(m.normalized_shape) != in_shape[1:2]:
        return False
    w = next(iter(_state(m).values()), None)
    if w is None or w.device.type == "meta":
        return False
    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(in_shape, generator=g, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        got = m(x)
        want = F.layer_norm(x.movedim(1, -1), m.normalized_shape, m.weight, m.bias, m.eps).movedim(-1, 1)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, atol=1e-5)


def owner_of(name: str, m: nn.Module, in_shape: tuple[int, ...], out_shapes: list[tuple[int, ...]],
             axis: int) -> Owner | str:
    """How module ``m`` (not a compressible layer, reading the tracked tensor as its first
    input) follows channels on ``axis`` of its input, or why it cannot."""
    ndim = len(in_shape)
    if [tuple(s) for s in out_shapes] != [tuple(in_shape)]:
        return f"module {name!r} ({type(m).__name__}) changes the shape of the channels it reads"
    if isinstance(m, nn.GroupNorm):
        if axis != 1:
            return f"GroupNorm {name!r} normalises another axis than the channels"
        # one channel per group: groups follow the channels; else keep every group, equal removal
        return Owner(GROUP_NORM, 1 if m.num_groups == m.num_channels else m.num_groups)
    if isinstance(m, (nn.LayerNorm, *((_RMS_NORM,) if _RMS_NORM else ()))):
        kind = RMS_NORM if _RMS_NORM and isinstance(m, _RMS_NORM) else LAYER_NORM
        want = 1 if getattr(m, "data_format", "channels_last") == "channels_first" or _channels_first(m, in_shape) \
            else ndim - 1
        if len(m.normalized_shape) != 1 or axis != want:
            return (f"{type(m).__name__} {name!r} normalises over {tuple(m.normalized_shape)}, not only the "
                    f"channel axis {axis} of its input {tuple(in_shape)}")
        return Owner(kind)
    if type(m).__module__.startswith("torch.nn."):
        return f"module {name!r} ({type(m).__name__}) uses the channels in a way filter pruning cannot follow"
    return _generic(name, m, in_shape, axis)


def parameter_owner(t_shape: tuple[int, ...], ndim: int, axis: int, channels: int) -> bool:
    """Is a parameter of shape ``t_shape``, broadcast against an ``ndim``-dim tensor whose
    channels (``channels`` of them) sit on ``axis``, one value per channel?"""
    d = axis - (ndim - len(t_shape))
    return 0 <= d and t_shape[d] == channels and all(n == 1 for i, n in enumerate(t_shape) if i != d)


def owner_size(m: nn.Module | torch.Tensor) -> int | None:
    """The channel count of an owner (module or bare parameter), or None when it owns tensors
    that are not all per-channel vectors of one size (then it is not an owner)."""
    tensors = [m] if isinstance(m, torch.Tensor) else list(_state(m).values())
    sizes = {t.shape[d] if (d := vector_dim(t)) is not None else None for t in tensors}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def sliced(m: nn.Module, keep: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """New tensors and attributes of an owner module that keeps channels ``keep``."""
    tensors = {}
    for attr, t in _state(m).items():
        tensors[attr] = t.data.index_select(vector_dim(t), torch.tensor(keep, dtype=torch.long, device=t.device))
    n, ints = len(keep), {}
    if isinstance(getattr(m, "normalized_shape", None), (tuple, list)):
        ints["normalized_shape"] = (n,)  # F.layer_norm / F.rms_norm read it
    if isinstance(m, nn.GroupNorm):
        ints["num_channels"] = n
        if m.num_groups == m.num_channels:
            ints["num_groups"] = n
    return tensors, ints
