"""Every classification family of torchvision.models (small random-weight instances,
torchvision_families.py) x the three configs through the whole lifecycle (lifecycle.run):
create, a few SGD steps, checkpoint, exact restore, save, both ONNX files in ONNX Runtime and
the deploy file in OpenVINO."""

import pytest

from tests.zoo.lifecycle import CONFIGS, run
from tests.zoo.vision import cases, check, one_thread

pytestmark = pytest.mark.slow

from tests.zoo.torchvision_families import BUILDERS, build  # noqa: E402  (skips without torchvision)

# Runs whose deploy file ORT runs as fake-quant (cosine >= 0.999) but OpenVINO's CPU plugin does
# not (median cosine to fake-quant, OpenVINO 2026.4, AMD EPYC): on MNASNet its int8 Add rounds
# 12 % of the first residual sum where they part (layers.8) one step otherwise, and the blocks
# after carry it on. docs/limits.md lists it; floor: the figure less 0.02.
OPENVINO_GAPS = {("MNASNet", "int8"): 0.9946, ("MNASNet", "2:4+int8"): 0.9949}


@pytest.mark.parametrize(("family", "config"), cases({f: list(CONFIGS) for f in BUILDERS}, {}))
def test_torchvision_zoo(tmp_path, family, config):
    with one_thread():
        r = run(lambda: build(family), CONFIGS[config], str(tmp_path))
    check(r, config, openvino_floor=OPENVINO_GAPS.get((family, config), 1.015) - 0.02)
