"""A tolerance search with a selection method holds one model: its trials are masks on the
caller's model. Peak RSS in a fresh process (benchmarks/prune_family.py's memory child)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, checkout_env

pytestmark = pytest.mark.slow


def _child(mode: str) -> dict:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "prune_family.py"), "memory-child", mode],
                         capture_output=True, text=True, check=True, env=checkout_env(), timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_masked_tolerance_search_grows_the_process_by_a_fraction_of_the_model():
    got = _child("masks")
    assert got["chosen"] == 0.6
    assert got["growth_x_model"] < 0.25, got
