"""Whether ONNX Runtime's integer kernels on this CPU compute the deploy model exactly.

The deploy model multiplies uint8 activations by int8 weights (the fast layout on VNNI and AMX
CPUs, docs/dev/platform.md). On x86-64 CPUs without VNNI, ORT's u8s8 kernels (MLAS, AVX2 and plain
AVX-512) multiply with ``vpmaddubsw``, which adds pairs of u8 x s8 products in int16 and
saturates: two products of 255 x 127 overflow it. ORT documents the limitation (its quantizer's
``reduce_range`` option, 7-bit weights, exists for it). There the deploy model's outputs are not
the fake-quant model's up to rounding: measured on an AVX2-only AMD EPYC, logits of the test
CNNs off by 6-23 % of their range (cosine 0.971-0.996), where VNNI machines stay within 1 %.
The file itself is right: the same file on a VNNI CPU, or on another runtime, computes it.
"""

from __future__ import annotations

import functools
import logging
import platform

logger = logging.getLogger(__name__)

__all__ = ["cpu_flags", "saturation_note", "u8s8_saturates", "warn_if_u8s8_saturates"]

_EXACT = ("avx512_vnni", "avx_vnni", "amx_int8")  # dot products accumulated in int32


def cpu_flags(cpuinfo: str) -> set[str]:
    """The ``flags`` of the first processor in a Linux ``/proc/cpuinfo`` text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def u8s8_saturates(machine: str | None = None, cpuinfo: str | None = None) -> bool:
    """True on an x86-64 CPU without VNNI or AMX (known from /proc/cpuinfo); False elsewhere,
    or when the flags cannot be read."""
    machine = platform.machine().lower() if machine is None else machine.lower()
    if machine not in ("x86_64", "amd64"):
        return False
    flags = _host_flags() if cpuinfo is None else cpu_flags(cpuinfo)
    return bool(flags) and not any(f in flags for f in _EXACT)


@functools.cache
def _host_flags() -> frozenset[str]:
    """This machine's flags, read once (empty when /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return frozenset(cpu_flags(f.read()))
    except OSError:
        return frozenset()


def saturation_note(what: str) -> str:
    """The line a report prints under its ORT figures on such a CPU; ``what``: those figures."""
    return (f"note: this CPU is x86-64 without VNNI, where ONNX Runtime's uint8 x int8 kernels saturate: "
            f"{what} (docs/export.md)")


def warn_if_u8s8_saturates() -> bool:
    """Log, for the report about to be printed, that this CPU's ORT kernels saturate; whether
    they do. (Its callers print one report each: one WARNING per report.)"""
    saturates = u8s8_saturates()
    if saturates:
        logger.warning(
            "this CPU is x86-64 without VNNI: ONNX Runtime's uint8 x int8 kernels here add products in "
            "int16 and saturate, so the deploy model run here can differ from the fake-quant model by "
            "several percent of its output range. The file is right and runs exactly on CPUs with VNNI "
            "or AMX; see docs/export.md (integer kernels on CPUs without VNNI)")
    return saturates
