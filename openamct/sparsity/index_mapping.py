"""How a tensor's channel axis maps back to the channels of the layers that produced them.

A tensor that carries prunable channels has one tracked axis, described as a list of
segments laid end to end. Segment ``(gid, start, length, repeat)`` covers ``length*repeat``
positions: channels ``start .. start+length-1`` of group ``gid`` (start is 0 today: slicing the
channel axis stops pruning rather than splitting a group), each repeated ``repeat``
times in a row (a flatten of trailing spatial dims, or a depthwise channel multiplier).
``gid None`` marks positions nobody can prune (a graph input concatenated in). A concat
along the axis joins segment lists, a flatten multiplies the repeats, and element-wise ops
need both sides' lists to line up segment by segment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Segment:
    gid: int | None
    start: int
    length: int
    repeat: int = 1

    @property
    def size(self) -> int:
        return self.length * self.repeat


@dataclass(frozen=True)
class ChannelMap:
    axis: int  # non-negative index into the tensor's shape
    segments: tuple[Segment, ...]

    @staticmethod
    def source(gid: int, axis: int, channels: int) -> ChannelMap:
        return ChannelMap(axis, (Segment(gid, 0, channels),))

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments)

    def gids(self) -> list[int]:
        return list(dict.fromkeys(s.gid for s in self.segments if s.gid is not None))

    def placed(self) -> list[tuple[Segment, int]]:
        """(segment, offset of its first position on the axis) for every tracked segment."""
        out, offset = [], 0
        for s in self.segments:
            if s.gid is not None:
                out.append((s, offset))
            offset += s.size
        return out

    def moved(self, axis: int) -> ChannelMap:
        return replace(self, axis=axis)

    def expanded(self, factor: int) -> ChannelMap:
        """Each position becomes ``factor`` consecutive positions."""
        if factor == 1:
            return self
        return replace(self, segments=tuple(replace(s, repeat=s.repeat * factor) for s in self.segments))

    @staticmethod
    def joined(axis: int, parts: list[ChannelMap | int]) -> ChannelMap:
        """Concatenation along the axis; an int part is that many untracked positions."""
        segs: list[Segment] = []
        for p in parts:
            segs.extend(p.segments if isinstance(p, ChannelMap) else (Segment(None, 0, p),))
        return ChannelMap(axis, tuple(segs))


def align(a: ChannelMap, b: ChannelMap) -> list[tuple[int | None, int | None]] | None:
    """Pairs of gids that sit on the same positions, or None when the layouts differ (the
    two sides could then not keep the same positions after pruning)."""
    if len(a.segments) != len(b.segments):
        return None
    pairs = []
    for x, y in zip(a.segments, b.segments, strict=True):
        if (x.start, x.length, x.repeat) != (y.start, y.length, y.repeat):
            return None
        pairs.append((x.gid, y.gid))
    return pairs


def reshape_axis(in_shape: tuple[int, ...], out_shape: tuple[int, ...], axis: int) -> tuple[int, int] | None:
    """(new axis, repeat factor) when a view/reshape keeps the channel dim whole, possibly
    merged with the dims right after it (N,C,H,W -> N,C*H*W gives factor H*W); None when it
    splits the channel dim or merges it with a dim before it."""
    before, c = math.prod(in_shape[:axis]), in_shape[axis]
    merged = [c * math.prod(in_shape[axis + 1:m]) for m in range(axis + 1, len(in_shape) + 1)]
    prefix = 1
    for k, d in enumerate(out_shape):
        if prefix == before and d in merged:
            return k, d // c
        prefix *= d
        if prefix > before:
            break
    return None


def broadcast_dim(shape: tuple[int, ...], out_ndim: int, out_axis: int) -> int | None:
    """The dim of an input of ``shape`` that lines up with ``out_axis`` of a broadcast
    output, or None when the input has no such dim or has size 1 there (it is broadcast)."""
    d = out_axis - (out_ndim - len(shape))
    if d < 0 or shape[d] == 1:
        return None
    return d


def index_axis(index: object, ndim: int, axis: int) -> tuple[int | None, str]:
    """Where ``axis`` goes under ``x[index]`` (basic indexing only): (new axis, "") if the
    channel dim is taken whole, (None, why) otherwise."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool) for i in items):
        return None, "advanced (tensor/list) indexing"
    if items.count(Ellipsis) > 1:
        return None, "unsupported index"
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        e = items.index(Ellipsis)
        items = items[:e] + [slice(None)] * (ndim - used) + items[e + 1:]
    else:
        items += [slice(None)] * (ndim - used)
    src, dst = 0, 0
    for i in items:
        if i is None:
            dst += 1
            continue
        if src == axis:
            if isinstance(i, slice) and i == slice(None):
                return dst, ""
            return None, "indexes or slices the channel axis"
        if isinstance(i, slice):
            dst += 1
        src += 1
    return None, "unsupported index"


def dims_arg(value: object, ndim: int) -> list[int] | None:
    """Normalise a ``dim`` argument (int, tuple or list) to non-negative ints; None if absent."""
    if value is None:
        return None
    vals = [value] if isinstance(value, int) else list(value)
    return [v % ndim for v in vals]


RESHAPE_OPS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as",
               "Flatten", "Unflatten"}
REDUCE_OPS = {"mean", "sum", "amax", "amin", "max", "min", "std", "var"}
SPLIT_OPS = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes"}
ALONG_OPS = {"softmax", "log_softmax", "cumsum", "cumprod", "flip", "roll"}  # act along given dims
AXIS_OPS = RESHAPE_OPS | REDUCE_OPS | SPLIT_OPS | ALONG_OPS | {"transpose", "swapaxes", "swapdims", "permute",
                                                             "getitem"}


def follow(op: str, args: tuple, kwargs: dict, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
           axis: int) -> tuple[int, int] | str:
    """Where the channel axis of a single-input shape op's input goes: (new axis, repeat
    factor), or why it cannot be followed. Transpose/permute move the axis; that is safe because
    every consumer and element-wise op checks the axis it reads the channels on."""
    ndim = len(in_shape)

    def arg(pos: int, key: str, default: object = None) -> object:
        return args[pos] if len(args) > pos else kwargs.get(key, default)

    if op in RESHAPE_OPS:
        moved = reshape_axis(in_shape, out_shape, axis)
        return moved or f"{op} splits the channel dim or merges it with a dim before it"
    if op in REDUCE_OPS:
        dims, keep = dims_arg(arg(1, "dim"), ndim), bool(arg(2, "keepdim", False))
        if dims is None or axis in dims:
            return f"{op} reduces over the channel axis"
        return (axis if keep else axis - sum(1 for d in set(dims) if d < axis)), 1
    if op in SPLIT_OPS:
        dim = dims_arg(arg(1 if op == "unbind" else 2, "dim", 0), ndim)[0]
        if dim == axis:
            return f"{op} cuts the channel axis"
        return axis - (1 if op == "unbind" and dim < axis else 0), 1
    if op in ALONG_OPS:
        dims = dims_arg(arg(2 if op == "roll" else 1, "dims" if op in ("flip", "roll") else "dim"), ndim)
        return f"{op} works along the channel axis" if dims is None or axis in dims else (axis, 1)
    if op in ("transpose", "swapaxes", "swapdims"):
        pair = dims_arg([arg(1, "dim0"), arg(2, "dim1")], ndim)
        return (pair[1] if axis == pair[0] else pair[0] if axis == pair[1] else axis), 1
    if op == "permute":
        perm = args[1:] if len(args) > 2 or isinstance(arg(1, "dims"), int) else arg(1, "dims")
        return dims_arg(list(perm), ndim).index(axis), 1
    if op == "getitem":
        new, why = index_axis(arg(1, "index"), ndim, axis)
        return (new, 1) if new is not None else why
    return f"{op} is not an op channel pruning can pass through"
