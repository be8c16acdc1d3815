"""Every classification family of torchvision.models (small random-weight instances,
torchvision_families.py) x the three configs through the whole lifecycle (lifecycle.run):
create, a few SGD steps, checkpoint, exact restore, save, both ONNX files in ONNX Runtime and
the deploy file in OpenVINO."""

import pytest

from tests.zoo.lifecycle import CONFIGS, run
from tests.zoo.vision import cases, check, one_thread

pytestmark = pytest.mark.slow

from tests.zoo.torchvision_families import BUILDERS, build  # noqa: E402  (skips without torchvision)


@pytest.mark.parametrize(("family", "config"), cases({f: list(CONFIGS) for f in BUILDERS}, {}))
def test_torchvision_zoo(tmp_path, family, config):
    with one_thread():
        r = run(lambda: build(family), CONFIGS[config], str(tmp_path))
    check(r, config)
