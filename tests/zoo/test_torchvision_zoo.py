"""Every classification family of torchvision.models (small random-weight instances,
torchvision_families.py) x the three configs through the whole lifecycle (lifecycle.run):
create, a few SGD steps, checkpoint, exact restore, save, both ONNX files in ONNX Runtime and
the deploy file in OpenVINO. Known failures are xfail(strict) with the error they raise."""

import pytest

from tests.zoo.lifecycle import CONFIGS, run
from tests.zoo.vision import cases, check, one_thread

pytestmark = pytest.mark.slow

from tests.zoo.torchvision_families import BUILDERS, build  # noqa: E402  (skips without torchvision)

KNOWN = {
    **{("MNASNet", c): "restore: 'version should be set to 1 or 2 instead of None': the checkpoint is loaded "
                       "a part at a time without the state dict's _metadata, and MNASNet's "
                       "_load_from_state_dict needs its version (openamct/checkpoint.py load_into)"
       for c in CONFIGS},
    ("MaxViT", "int8"): "OpenVINO's run of the deploy file disagrees with ORT's (cosine 0.93, ORT 0.9998)",
    ("MaxViT", "2:4+int8"): "OpenVINO's run of the deploy file disagrees with ORT's (cosine 0.95, ORT 0.9998)",
    ("MaxViT", "filter0.3+int8"): "training: shape '[2, 16, 4, 11]' is invalid for input of size 2048: filter "
                                  "pruning cuts the attention's qkv Linear that a reshape by the stored head "
                                  "count reads (openamct/prune channel-dependency analysis)",
}


@pytest.mark.parametrize(("family", "config"), cases({f: list(CONFIGS) for f in BUILDERS}, KNOWN))
def test_torchvision_zoo(tmp_path, family, config):
    with one_thread():
        r = run(lambda: build(family), CONFIGS[config], str(tmp_path))
    check(r, config)
