"""What channel-dependency analysis hands to filter pruning: coupled groups, and the ones it
had to leave alone (with the reason, for logs and ``openamct inspect``)."""

from __future__ import annotations

from dataclasses import dataclass

# ONNX op types of the record nodes that are function calls, not modules (nothing to slice).
FUNCTION_OP_TYPES = ("Add", "Sub", "Mul", "Div", "Concat")


@dataclass
class Member:
    """One place a group's channels live.

    Channel ``c`` of the group occupies positions ``begin + c*repeat .. begin + (c+1)*repeat - 1``
    of the member's own channel axis: the output channels of a producer, the features of a
    BatchNorm, the (output) channels of a depthwise conv, the input channels / features of a
    consumer. ``repeat`` > 1 comes from a flatten that merged spatial dims into channels
    (Conv -> flatten -> Linear) or a depthwise channel multiplier; ``end - begin`` is
    therefore ``channels * repeat``.
    """

    name: str  # module path, or a function node name such as "add_3"
    op_type: str  # ONNX-style type written to the record: "Conv", "Gemm", "BatchNormalization", ...
    begin: int
    end: int
    repeat: int = 1
    group: int = 1  # conv groups of the module (1 for anything else)
    role: str = "consumer"  # "producer" | "consumer" | "passive"

    @property
    def is_function(self) -> bool:
        return self.op_type in FUNCTION_OP_TYPES

    def positions(self, channels: list[int]) -> list[int]:
        """Positions on the member's axis that group channels ``channels`` occupy."""
        r = self.repeat
        return [self.begin + c * r + j for c in channels for j in range(r)]


@dataclass
class PruneGroup:
    """Channels that must be pruned together: every producer loses the same output channels
    and every passive member / consumer the matching positions."""

    producers: list[Member]
    consumers: list[Member]
    passive: list[Member]
    channels: int
    prune_group: int  # removal is equal within each of this many contiguous channel blocks
    ratio: float
    ascend_optimized: bool
    removed: list[int] | None = None  # removed channel indices in 0..channels-1, sorted

    @property
    def producer_names(self) -> list[str]:
        return [m.name for m in self.producers]

    def members(self) -> list[Member]:
        return [*self.producers, *self.passive, *self.consumers]


@dataclass
class BlockedGroup:
    """A coupled group that will not be pruned: ``at`` is the node or layer that stops it."""

    producers: list[str]
    at: str
    reason: str

    def describe(self) -> str:
        return f"{', '.join(self.producers)}: not pruned, blocked at {self.at}: {self.reason}"
