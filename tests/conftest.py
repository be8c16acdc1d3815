import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

COMPAT = os.path.join(ROOT, "tests", "fixtures", "amct-compat")


def compat_config(name: str) -> str:
    return os.path.join(COMPAT, "configs", name)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    # Small CNNs trained on digits drift into denormals, which cost 10-100x per step on CPU.
    torch.set_flush_denormal(True)
    yield
