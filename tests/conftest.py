import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

COMPAT = os.path.join(ROOT, "tests", "fixtures", "amct-compat")
# Folders whose every test is in the slow tier (`make test` runs them, `make test-fast` does not):
# acceptance trains real models to an accuracy bound, e2e runs whole scripts in subprocesses.
# Slow files elsewhere (fuzzing, subprocess workers, the zoo) carry `pytestmark = pytest.mark.slow`.
SLOW_FOLDERS = ("acceptance", "e2e")


def compat_config(name: str) -> str:
    return os.path.join(COMPAT, "configs", name)


def checkout_env(**extra: str) -> dict[str, str]:
    """Environment for a subprocess that must import this checkout's ``openamct``: a script run
    by path puts its own folder first on sys.path, so without this it would get the package the
    virtualenv has installed, which may be another checkout (a git worktree sharing the venv)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the tests of SLOW_FOLDERS slow, before ``-m`` selects on the marks."""
    tests = os.path.join(ROOT, "tests")
    for item in items:
        rel = os.path.relpath(str(item.path), tests)
        if rel.split(os.sep, 1)[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    # Small CNNs trained on digits drift into denormals, which cost 10-100x per step on CPU.
    torch.set_flush_denormal(True)
    yield
