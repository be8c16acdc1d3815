"""22 Hugging Face families x 3 configs through the whole lifecycle: create, a few
SGD steps, eval, checkpoint, restore (outputs equal, asserted in lifecycle.run), save, and both
ONNX files run in ONNX Runtime. Small configs with re-initialised random weights
(families.py): a run takes a second or two.

Fidelity bound: the fake-quant file reproduces the compressed PyTorch model: the same
arithmetic in another runtime, where only float accumulation order differs. That order differs
between CPUs and kernels, and now and then it puts a value an ulp across a rounding midpoint
of the next quantizer: that element moves a whole quantization step, and a deep random network
(MobileViT: 90 quantized layers) carries it to the output (seen: cosine 0.9989 on one input,
1.0 on others). Such a flip is a property of one input; a wrong export (a lost quantizer, a
wrong scale, an unfolded BN) is wrong on every input. So the test takes 5 input batches and
asserts the median cosine >= 0.999 and the worst >= 0.99: a real regression fails both, a
rare flip on one batch fails neither, on any CPU. deploy vs fake-quant is reported, not
bounded: on random-weight deep CNNs (MobileNetV1/V2, MobileViT) the int32 bias rounding and the
integer kernels' rounding amplify, through layers that quantize on a midpoint, into cosines of
0.85-0.99 (docs/limits.md). The same deploy file runs in OpenVINO; where ORT's run
agrees with fake-quant (cosine >= 0.999: measured OpenVINO >= 0.9983 there), OpenVINO must too.
"""

import numpy as np
import pytest

from tests.zoo.families import FAMILIES, build
from tests.zoo.lifecycle import CONFIGS, run
from tests.zoo.vision import WELL_CONDITIONED, fake_bounds

pytestmark = pytest.mark.slow

# Families where prune_ratio 0.3 reaches >= 25 % of the compressed layers' weight: the
# filter-prune groups get through norms over the channels, GRN, LayerScale, permutes and whole
# attention heads, GPT-2's fused c_attn split and T5's per-head relative position bias. ALBERT is
# out (shared layers). ViT/DeiT/Wav2Vec2/Whisper reach ~20 % here, because their unpruned front
# ends weigh 18-27 % of these tiny configs; their bound is asserted at the sizes they ship in,
# in test_prune_reach_full_size.py.
PRUNE_REACHES = {"ResNet", "ConvNeXt", "ConvNeXtV2", "MobileNetV1", "MobileNetV2", "EfficientNet", "RegNet",
                 "MobileViT", "Swin", "SegFormer", "BERT", "DistilBERT", "RoBERTa", "Llama", "Qwen2", "GPT-2",
                 "T5-encoder"}


# MobileViT (90 quantized layers, random weights) amplifies flips furthest: on an AMD EPYC its
# int8 run measured median 1.0000 and worst 0.934 over the 5 batches, where torch against itself
# under the noise reads 0.9983 (worst batch 0.9948): one batch's flip that the noise did not
# happen to draw. A lost quantizer or a wrong scale moves every batch, which the median catches.
FIDELITY = {"MobileViT": (0.98, 0.9)}  # family -> (median, worst) cosine bounds on a chaotic run

# Deploy files OpenVINO runs differently from ONNX Runtime on some CPUs, while ORT's run of the
# same file reproduces fake-quant: family -> (CPU flag, what was measured). The run is still
# loaded, run and checked finite there; docs/limits.md lists it.
OPENVINO_DIVERGES = {
    "Wav2Vec2": ("amx_int8", "OpenVINO 2026.4 on a Xeon with AMX: cosine 0.70-0.78 to fake-quant in all three "
                             "configs, where ORT gives 0.999+ (the same at the previous release of openamct)"),
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_zoo_lifecycle(tmp_path, family, config):
    r = run(lambda: build(family), CONFIGS[config], str(tmp_path))
    assert r["quantized"] > 0
    if config.startswith("2:4"):
        assert r["sparse"] > 0
    median, worst = fake_bounds(r, FIDELITY.get(family, (0.999, 0.99)))
    assert r["fake_vs_torch"] >= median and r["fake_vs_torch_min"] >= worst, r
    # OpenVINO loads and runs every deploy file; where ORT's run reproduces fake-quant on a
    # well-conditioned run, so does it (on a chaotic one, MobileViT int8 at 0.998 against itself
    # under the noise, one element its int8 kernels round otherwise carries to the output)
    assert np.isfinite(r["openvino_vs_fake"]), r
    diverges = family in OPENVINO_DIVERGES and OPENVINO_DIVERGES[family][0] in _cpu_flags()
    if r["deploy_vs_fake"] >= 0.999 and r["self_vs_noise"] >= WELL_CONDITIONED and not diverges:
        assert r["openvino_vs_fake"] >= 0.995, r
    if config.startswith("filter") and family in PRUNE_REACHES:
        assert r["removed_share"] >= 0.25, r
