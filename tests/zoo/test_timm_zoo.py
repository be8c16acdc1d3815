"""32 timm families (one small random-weight member each, timm_families.TESTED) through the whole
lifecycle (lifecycle.run) under INT8, and four of them under all three configs: create, a few SGD
steps, checkpoint, exact restore, save, both ONNX files in ONNX Runtime and the deploy file in
OpenVINO (known divergences held at their figures: DEPLOY_GAPS, OPENVINO_GAPS); the table
(python -m tests.zoo.table timm) covers every family and config."""

import pytest

from tests.zoo.lifecycle import CONFIGS, run
from tests.zoo.vision import cases, check, one_thread

pytestmark = pytest.mark.slow

from tests.zoo.timm_families import TESTED, build  # noqa: E402  (skips without timm)

ALL_CONFIGS = ("ResNet-T", "TF-EfficientNet-Lite", "RepVGG", "ConvNeXt")
# family -> (median, worst) fake-vs-torch cosine bounds for runs vision.check counts as chaotic
# (compressed model against itself under 1e-6 input noise: MobileViT 0.998, VoVNet-ESE 0.997),
# where random-weight deep nets amplify one-ulp quantizer flips (tests/zoo/test_zoo.py says why)
FIDELITY = {"MobileViT": (0.98, 0.95), "VoVNet-ESE": (0.99, 0.98)}
# A well-conditioned run whose deploy file departs from fake-quant (median cosine measured on an
# Intel Xeon with AMX): a Hardswish output that a conv and a residual Add read; training rounds it
# only for the conv, the deploy file for the Add too (QLinearAdd; export/deploy.py). The floor is
# the figure less 0.02, so a regression still fails; docs/limits.md lists it.
DEPLOY_GAPS = {("EfficientViT-MIT", "int8"): 0.975}
# Runs whose deploy file ORT runs as fake-quant (cosine >= 0.999) but OpenVINO's CPU plugin does
# not (median cosine to fake-quant, Intel Xeon with AMX, OpenVINO 2026.4): its fused int8 kernels
# round some quantizers' inputs otherwise (DLA: 525 of 16384 values one step off at the
# requantize into level2.root's conv, which that tensor cut as the output does not show), and
# MobileViT is a chaotic run that carries such flips to the output (0.937 with the deploy file
# that held a deploy-only quantizer there too). docs/limits.md lists them; floor: less 0.02.
OPENVINO_GAPS = {("DLA", "int8"): 0.991, ("MobileViT", "int8"): 0.937}


@pytest.mark.parametrize(("family", "config"), cases(
    {f: list(CONFIGS) if f in ALL_CONFIGS else ["int8"] for f in TESTED}, {}))
def test_timm_zoo(tmp_path, family, config):
    with one_thread():
        r = run(lambda: build(family), CONFIGS[config], str(tmp_path))
    check(r, config, FIDELITY.get(family, (0.999, 0.99)), DEPLOY_GAPS.get((family, config), 1.01) - 0.02,
          OPENVINO_GAPS.get((family, config), 1.015) - 0.02)
