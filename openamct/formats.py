"""Number formats as data: bits, signedness, symmetry and granularity of a quantizer.

The plan names a format (the config's ``dst_type``), the quantizers take their integer range
from it, the record writes its name (``act_type`` / ``wts_type``; INT8, the proto default, is
never written) and the export maps it to an ONNX element type (``export/element_types.py``).

The integer range is the full two's-complement one, ``-2^(b-1) .. 2^(b-1) - 1`` (INT8
-128..127, INT4 -8..7), for activations and weights alike: that is the clamp torch's
fake-quantize kernels and ONNX Runtime's QuantizeLinear apply. ARQ divides max|w| by ``qmax``,
so its weights use the symmetric part (-127..127, -7..7) and ``qmin`` is only reached by a
learned (ULQ) scale that clips; INT4 keeps that convention so INT8 and INT4 share one formula.

This module sits at the bottom of the package (no torch, no onnx): the config, the record
checks, the quantizers and the export all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

__all__ = ["QuantFormat", "INT8_ACT", "INT8_WEIGHT", "INT4_WEIGHT", "INT16_ACT", "UINT8_ACT", "DEFAULT",
           "activation_format", "weight_format", "unsigned", "check_format", "WEIGHT_FORMATS", "ACTIVATION_FORMATS",
           "QAT_MODULE_ACTIVATION_FORMATS"]

DEFAULT = "INT8"  # the config's and the record's default data type


@dataclass(frozen=True)
class QuantFormat:
    """One integer format. ``per_channel`` formats have one scale per slice along ``axis`` (the
    output channels of a weight in its channel-major layout, ``quant.functions.to_channel_major``);
    per-tensor ones have ``axis`` None."""

    name: str  # the DataType name in the config and the record ("INT8", "INT4")
    bits: int
    signed: bool = True
    symmetric: bool = True  # zero point fixed at 0
    per_channel: bool = False
    axis: int | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 16:
            raise ValueError(f"QuantFormat {self.name}: bits must be in 2..16, got {self.bits}")
        if self.per_channel != (self.axis is not None):
            raise ValueError(f"QuantFormat {self.name}: a per-channel format needs an axis, a per-tensor one none")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def levels(self) -> int:
        """Steps between the outermost levels (2^b - 1): the clip range is ``levels`` scales."""
        return self.qmax - self.qmin

    def granular(self, per_channel: bool) -> QuantFormat:
        """This format per output channel (axis 0) or per tensor."""
        return replace(self, per_channel=per_channel, axis=0 if per_channel else None)


INT8_ACT = QuantFormat("INT8", 8, signed=True, symmetric=False)  # ULQ: asymmetric, per tensor
INT8_WEIGHT = QuantFormat("INT8", 8, per_channel=True, axis=0)  # ARQ / ULQ weights (or .granular(False))
INT4_WEIGHT = QuantFormat("INT4", 4, per_channel=True, axis=0)  # weight-only

# INT16 activations: the single-op QAT modules' only (openamct.nn). Their deploy model reads
# them through ONNX Runtime's int16 QuantizeLinear/DequantizeLinear (com.microsoft domain, CPU),
# in front of a float kernel: ORT has no int16 Conv/Gemm.
INT16_ACT = QuantFormat("INT16", 16, signed=True, symmetric=False)

def check_format(fmt, symmetric: bool) -> QuantFormat:
    """``fmt`` when it is a QuantFormat of that symmetry (a quantizer's constructor check)."""
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"fmt: expected a QuantFormat, got {type(fmt).__name__}")
    if fmt.symmetric != symmetric:
        raise ValueError(f"fmt: {fmt.name} is {'' if fmt.symmetric else 'a'}symmetric; this quantizer needs "
                         f"{'a symmetric' if symmetric else 'an asymmetric'} format")
    return fmt


# The deploy model's activations: ONNX Runtime's fast CPU integer kernels read uint8 activations
# (int8 ones ran no faster than FP32), so a trained INT8 grid goes out as the UINT8 grid of the
# same scale, its zero point moved up by ``unsigned(fmt)``'s shift (``-fmt.qmin``: 128).
UINT8_ACT = QuantFormat("UINT8", 8, signed=False, symmetric=False)


def unsigned(fmt: QuantFormat) -> tuple[QuantFormat, int]:
    """The unsigned format of ``fmt``'s width and what a zero point moves by into it."""
    return replace(fmt, name=f"UINT{fmt.bits}", signed=False), -fmt.qmin


# Which config/record DataType names each role accepts (per-channel entries; ``weight_format``
# sets the granularity a layer asks for).
WEIGHT_FORMATS = MappingProxyType({f.name: f for f in (INT8_WEIGHT, INT4_WEIGHT)})
ACTIVATION_FORMATS = MappingProxyType({INT8_ACT.name: INT8_ACT})
# The data formats a single-op QAT module's config may name (openamct.nn.module.quantization).
QAT_MODULE_ACTIVATION_FORMATS = MappingProxyType({f.name: f for f in (INT8_ACT, INT16_ACT)})


def weight_format(name: str, channel_wise: bool) -> QuantFormat:
    """The weight format called ``name`` (a DataType name), per output channel or per tensor."""
    fmt = WEIGHT_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"weight format {name!r} is not supported; use one of {', '.join(WEIGHT_FORMATS)}")
    return fmt.granular(channel_wise)


def activation_format(name: str) -> QuantFormat:
    """The activation format called ``name``; INT4 is a weight-only format."""
    fmt = ACTIVATION_FORMATS.get(name)
    if fmt is None:
        extra = " (INT4 is for weights only; activations stay INT8)" if name in WEIGHT_FORMATS else ""
        raise ValueError(f"activation format {name!r} is not supported for activations{extra}; "
                         f"use one of {', '.join(ACTIVATION_FORMATS)}")
    return fmt
