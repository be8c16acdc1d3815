"""``benchmarks/gpu_check.py`` runs start to end, section by section, before any GPU meets it:
here on the CPU with tiny batches (the memory figures, CUDA's sync counter and DDP need CUDA)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # (its dataclasses look their module up there)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gpu_check", None)


def test_every_section_runs_on_the_cpu(gpu_check, capsys):
    assert gpu_check.main(["--device", "cpu", "--quick", "--steps", "1", "--skip", "compile"]) == 0
    out = capsys.readouterr().out
    for line in ("cnn fp16+scaler: step", "transformer bf16: step", "1 values read back",
                 "restore onto a cpu model: identical", "DDP: not run", "all sections passed"):
        assert line in out, out


def test_a_failing_section_is_reported_and_the_rest_still_run(gpu_check, capsys, monkeypatch):
    def broken(kind, run):
        raise RuntimeError(f"{kind} broke")

    monkeypatch.setattr(gpu_check, "section_syncs", broken)
    assert gpu_check.main(["--device", "cpu", "--quick", "--steps", "1", "--skip", "steps,compile"]) == 1
    out = capsys.readouterr().out
    assert "RuntimeError: cnn broke" in out and "restore onto a cpu model: identical" in out
    assert "2 section(s) failed: syncs cnn, syncs transformer" in out
