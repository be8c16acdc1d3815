"""What the torchvision and timm zoo tests share: the parameter list with the known failures
marked xfail(strict) per (family, config), so that a fix flips them loudly, and the checks on one
lifecycle run (the Hugging Face zoo's, tests/zoo/test_zoo.py, which says why these bounds)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for a run, as ORT and OpenVINO are (lifecycle.py): on a machine whose
    cores other jobs share, torch's thread pool spinning on 2 threads made the torchvision zoo
    run 5x slower than on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cases(configs: dict[str, list[str]], known: dict[tuple[str, str], str]) -> list:
    """pytest params (family, config) for ``configs`` (family -> config names)."""
    unknown = set(known) - {(f, c) for f, names in configs.items() for c in names}
    assert not unknown, f"known failures of cases that do not run: {sorted(unknown)}"
    return [pytest.param(f, c, id=f"{f}-{c}",
                         marks=[pytest.mark.xfail(strict=True, reason=known[f, c])] if (f, c) in known else [])
            for f, names in configs.items() for c in names]


def check(r: dict, config: str, fidelity: tuple[float, float] = (0.999, 0.99)) -> None:
    """One lifecycle.run result: something quantized (and 2:4-sparse), the fake-quant file
    reproduces the compressed model, filter pruning removes something, (median and worst of 5 batches), OpenVINO runs the deploy
    file and agrees with ORT's run of it where that reproduces fake-quant."""
    assert r["quantized"] > 0, r
    if config.startswith("2:4"):
        assert r["sparse"] > 0, r
    if config.startswith("filter"):
        assert r["pruned"] > 0 and r["removed_share"] > 0, r
    median, worst = fidelity
    assert r["fake_vs_torch"] >= median and r["fake_vs_torch_min"] >= worst, r
    assert np.isfinite(r["openvino_vs_fake"]), r
    if r["deploy_vs_fake"] >= 0.999:
        assert r["openvino_vs_fake"] >= 0.995, r
