"""32 timm families (one small random-weight member each, timm_families.TESTED) through the whole
lifecycle (lifecycle.run) under INT8, and four of them under all three configs: create, a few SGD
steps, checkpoint, exact restore, save, both ONNX files in ONNX Runtime and the deploy file in
OpenVINO. Known failures are xfail(strict) with the error they raise; the table
(python -m tests.zoo.table timm) covers every family and config."""

import pytest

from tests.zoo.lifecycle import CONFIGS, run
from tests.zoo.vision import cases, check, one_thread

pytestmark = pytest.mark.slow

from tests.zoo.timm_families import TESTED, build  # noqa: E402  (skips without timm)

ALL_CONFIGS = ("ResNet-T", "TF-EfficientNet-Lite", "RepVGG", "ConvNeXt")
OPENVINO_CONST_CONV = ("OpenVINO fails to compile the deploy file ('contains empty child edge' at the quantized "
                       "Conv of PositionalEncodingFourier, whose input is input-independent)")
KNOWN = {
    ("EdgeNeXt", "int8"): OPENVINO_CONST_CONV,
}
# family -> (median, worst) fake-vs-torch cosine bounds for runs vision.check counts as chaotic
# (compressed model against itself under 1e-6 input noise: MobileViT 0.998, VoVNet-ESE 0.997),
# where random-weight deep nets amplify one-ulp quantizer flips (tests/zoo/test_zoo.py says why)
FIDELITY = {"MobileViT": (0.98, 0.95), "VoVNet-ESE": (0.99, 0.98)}
# Well-conditioned runs whose deploy file departs from fake-quant (median cosine measured on an
# Intel Xeon with AMX): a deploy-only rounding step not yet found; docs/limits.md lists them. The
# floor is the figure less 0.02, so a regression still fails.
DEPLOY_GAPS = {("ResNeSt", "int8"): 0.970, ("DLA", "int8"): 0.801, ("DPN", "int8"): 0.916,
               ("FasterNet", "int8"): 0.956, ("HGNetV2", "int8"): 0.929, ("ConvFormer", "int8"): 0.987,
               ("EfficientViT-MIT", "int8"): 0.975}


@pytest.mark.parametrize(("family", "config"), cases(
    {f: list(CONFIGS) if f in ALL_CONFIGS else ["int8"] for f in TESTED}, KNOWN))
def test_timm_zoo(tmp_path, family, config):
    with one_thread():
        r = run(lambda: build(family), CONFIGS[config], str(tmp_path))
    check(r, config, FIDELITY.get(family, (0.999, 0.99)), DEPLOY_GAPS.get((family, config), 1.01) - 0.02)
