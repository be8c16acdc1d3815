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
           "QAT_MODULE_ACTIVATION_FORMATS", "FormatPair", "PAIRS", "REFUSED_PAIRS", "pair_name", "format_pair"]

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
# (INT16 is a graph-flow activation format only in the A16W8 pair, on LSTM/GRU: ``PAIRS``.)
ACTIVATION_FORMATS = MappingProxyType({f.name: f for f in (INT8_ACT, INT16_ACT)})
# The data formats a single-op QAT module's config may name (openamct.nn.module.quantization).
QAT_MODULE_ACTIVATION_FORMATS = MappingProxyType({f.name: f for f in (INT8_ACT, INT16_ACT)})


def weight_format(name: str, channel_wise: bool) -> QuantFormat:
    """The weight format called ``name`` (a DataType name), per output channel or per tensor."""
    fmt = WEIGHT_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"weight format {name!r} is not supported; use one of {', '.join(WEIGHT_FORMATS)}")
    return fmt.granular(channel_wise)


def activation_format(name: str) -> QuantFormat:
    """The activation format called ``name``; INT4 is a weight-only format. Which layer types
    take which activation and weight format together is ``PAIRS``' business."""
    fmt = ACTIVATION_FORMATS.get(name)
    if fmt is None:
        extra = " (INT4 is for weights only; activations stay INT8)" if name in WEIGHT_FORMATS else ""
        raise ValueError(f"activation format {name!r} is not supported for activations{extra}; "
                         f"use one of {', '.join(ACTIVATION_FORMATS)}")
    return fmt


# -- activation/weight pairs ------------------------------------------------------------------
# Upstream AMCT names a layer's formats together, "A<act bits>W<weight bits>", and accepts a
# pair only from its list. The table says, per pair, which layer types of the graph flow take it
# (None: every quantizable type). The single-op QAT modules (openamct.nn) read the same table
# with ``single_op=True``: they also take A16W8 on their convolutions and Linear.

@dataclass(frozen=True)
class FormatPair:
    name: str  # "A8W4"
    act: QuantFormat
    weight: QuantFormat  # per output channel; ``weight_format`` sets a layer's granularity
    layer_types: frozenset[str] | None = None  # graph-flow layer types that take it; None: all
    single_op_types: frozenset[str] | None = None  # the same for the single-op QAT modules


_RECURRENT = frozenset({"LSTM", "GRU"})
PAIRS = MappingProxyType({p.name: p for p in (
    FormatPair("A8W8", INT8_ACT, INT8_WEIGHT),
    # INT8 activations, INT4 weights: upstream's seven types (Conv1d/2d, ConvTranspose1d/2d,
    # Linear, LSTM, GRU) and the other weight layers openamct quantizes (Conv3d, transformers'
    # Conv1D), whose INT4 weights export the same way.
    FormatPair("A8W4", INT8_ACT, INT4_WEIGHT),
    # INT16 activations with INT8 weights: the recurrent layers in the graph flow (their input
    # and hidden state feed a float LSTM/GRU kernel in the deploy model); every single-op module.
    FormatPair("A16W8", INT16_ACT, INT8_WEIGHT, layer_types=_RECURRENT),
)})

# Pairs upstream refuses, with upstream's reason (its retrain config check). A4W4 is in
# upstream's list of names but refused before it: INT4 activations need INT4 retraining, which
# upstream's capacity table turns off.
_INT4_ACT = "Int4 quantization aware training is not supported (INT4 activations: upstream AMCT refuses them too)"
REFUSED_PAIRS = MappingProxyType({"A4W4": _INT4_ACT, "A4W8": _INT4_ACT})


def pair_name(act: str, weight: str) -> str:
    """Upstream's name of a pair of DataType names: ("INT8", "INT4") -> "A8W4"."""
    return f"A{act.removeprefix('INT')}W{weight.removeprefix('INT')}"


def format_pair(act: str, weight: str, layer_type: str, where: str, single_op: bool = False) -> FormatPair:
    """The pair of ``act`` and ``weight`` (DataType names) for a layer of ``layer_type``, or a
    ValueError that names ``where`` (the config field and the layer), the pair and the reason."""
    name = pair_name(act, weight)
    pair = PAIRS.get(name)
    if pair is None:
        why = REFUSED_PAIRS.get(name) or ("Activation and weights data_type are not supported for now "
                                          f"(upstream's message); supported pairs: {', '.join(PAIRS)}")
        raise ValueError(f"{where}: activation {act} with weights {weight} ({name}) is refused: {why}")
    types = pair.single_op_types if single_op else pair.layer_types
    if types is not None and layer_type not in types:
        raise ValueError(f"{where}: {name} (activation {act}, weights {weight}) is supported on "
                         f"{', '.join(sorted(types))} only, not on {layer_type}")
    return pair
