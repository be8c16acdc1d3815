"""Every classification family of torchvision.models (small random-weight instances,
torchvision_families.py) x the three configs through the whole lifecycle (lifecycle.run):
create, a few SGD steps, checkpoint, exact restore, save, both ONNX files in ONNX Runtime and
the deploy file in OpenVINO."""

import pytest

from tests.zoo.lifecycle import CONFIGS, run
from tests.zoo.vision import cases, check, one_thread

pytestmark = pytest.mark.slow

from tests.zoo.torchvision_families import BUILDERS, build  # noqa: E402  (skips without torchvision)

# Well-conditioned runs whose deploy file departs from fake-quant (median cosine measured on an
# Intel Xeon with AMX): a deploy-only rounding step not yet found; docs/limits.md lists them. The
# floor is the figure less 0.02, so a regression still fails.
DEPLOY_GAPS = {("MobileNetV3", "int8"): 0.97}


@pytest.mark.parametrize(("family", "config"), cases({f: list(CONFIGS) for f in BUILDERS}, {}))
def test_torchvision_zoo(tmp_path, family, config):
    with one_thread():
        r = run(lambda: build(family), CONFIGS[config], str(tmp_path))
    check(r, config, deploy_floor=DEPLOY_GAPS.get((family, config), 1.01) - 0.02)
