"""Which CPUs run ONNX Runtime's uint8 x int8 kernels with int16 saturation
(openamct/export/int8_kernels.py): x86-64 without VNNI or AMX."""

from __future__ import annotations

import logging

import pytest

from openamct.export import int8_kernels
from openamct.export.int8_kernels import cpu_flags, u8s8_saturates

EPYC_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: x\n"
EPYC_VNNI = "processor\t: 0\nflags\t\t: avx2 avx512f avx512bw avx512_vnni\n"
XEON_AMX = "processor\t: 0\nflags\t\t: avx2 avx512f amx_tile amx_int8 amx_bf16\n"
ALDER_LAKE = "processor\t: 0\nflags\t\t: avx2 avx_vnni\n"


def test_cpu_flags_reads_the_first_processor():
    assert cpu_flags(EPYC_AVX2) == {"fpu", "sse", "sse2", "avx", "avx2", "fma"}
    assert cpu_flags("no flags here") == set()


@pytest.mark.parametrize("machine,cpuinfo,saturates", [
    ("x86_64", EPYC_AVX2, True),
    ("x86_64", EPYC_VNNI, False),
    ("x86_64", XEON_AMX, False),
    ("AMD64", ALDER_LAKE, False),
    ("aarch64", EPYC_AVX2, False),  # not x86: other kernels
    ("x86_64", "", False),  # flags unknown: no claim
])
def test_x86_without_vnni_or_amx_saturates(machine, cpuinfo, saturates):
    assert u8s8_saturates(machine, cpuinfo) is saturates


def test_each_report_logs_the_warning_once_and_only_where_kernels_saturate(monkeypatch, caplog):
    """One WARNING per report (each caller prints one report per call), none where kernels are exact."""
    for value in (False, True):
        monkeypatch.setattr(int8_kernels, "u8s8_saturates", lambda v=value: v)
        with caplog.at_level(logging.WARNING, logger="openamct.export.int8_kernels"):
            caplog.clear()
            assert int8_kernels.warn_if_u8s8_saturates() is value
            assert len([r for r in caplog.records if "without VNNI" in r.getMessage()]) == int(value)
            assert int8_kernels.warn_if_u8s8_saturates() is value
        assert len([r for r in caplog.records if "without VNNI" in r.getMessage()]) == 2 * int(value)
