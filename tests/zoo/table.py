"""Print a zoo table (python -m tests.zoo.table [hf|torchvision|timm] [family ...]): per family
and config, the compressed layer counts, the share of compressed weight removed and the cosines (the
compressed model against itself under 1e-6 noise on its input and every layer's, which says where the
others can be held
to a bound: tests/zoo/vision.py; fake-quant file against torch; ORT's and OpenVINO's deploy runs
against the fake-quant file), or the step that failed and its error."""

import importlib
import logging
import sys
import tempfile
import traceback
import warnings

from tests.zoo.lifecycle import CONFIGS, run

ZOOS = {"hf": "tests.zoo.families", "torchvision": "tests.zoo.torchvision_families",
        "timm": "tests.zoo.timm_families"}


def _row(build, family: str, name: str, cfg: str) -> str:
    try:
        with tempfile.TemporaryDirectory() as d:
            r = run(lambda: build(family), cfg, d)
    except Exception as exc:  # the table reports failures, it does not stop at them
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/openamct/" in f.filename
                  or "/tests/" in f.filename]
        where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno}" if frames else "?"
        error = " ".join(str(exc).split())[:160].replace("|", "/")
        return f"| {family} | {name} | fails ({where}): {type(exc).__name__}: {error} ||||||||"
    return (f"| {family} | {name} | {r['quantized']} | {r['sparse']} | {r['pruned']} | "
            f"{100 * r['removed_share']:.0f} % | {r['self_vs_noise']:.5f} | {r['fake_vs_torch']:.5f} (min {r['fake_vs_torch_min']:.4f}) | "
            f"{r['deploy_vs_fake']:.4f} | {r['openvino_vs_fake']:.4f} |")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    zoo = importlib.import_module(ZOOS[sys.argv[1] if len(sys.argv) > 1 else "hf"])
    families = sys.argv[2:] or getattr(zoo, "FAMILIES", None) or zoo.BUILDERS
    print("| family | config | quantized | 2:4 | pruned | weight removed | torch vs itself, 1e-6 noise at every layer | "
          "fake vs torch | deploy vs fake | OpenVINO deploy vs fake |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for family in families:
        for name, cfg in CONFIGS.items():
            print(_row(zoo.build, family, name, cfg), flush=True)
