"""Print the zoo table (python -m tests.zoo.table): per family and config, the compressed layer
counts, the share of compressed weight removed and the cosines (ORT's and OpenVINO's deploy
runs against the fake-quant file)."""

import logging
import tempfile
import warnings

from tests.zoo.families import FAMILIES, build
from tests.zoo.lifecycle import CONFIGS, run

if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print("| family | config | quantized | 2:4 | pruned | weight removed | fake vs torch | deploy vs fake | "
          "OpenVINO deploy vs fake |")
    print("|---|---|---|---|---|---|---|---|---|")
    for family in FAMILIES:
        for name, cfg in CONFIGS.items():
            with tempfile.TemporaryDirectory() as d:
                r = run(lambda f=family: build(f), cfg, d)
            print(f"| {family} | {name} | {r['quantized']} | {r['sparse']} | {r['pruned']} | "
                  f"{100 * r['removed_share']:.0f} % | {r['fake_vs_torch']:.5f} (min {r['fake_vs_torch_min']:.4f}) | {r['deploy_vs_fake']:.4f} | {r['openvino_vs_fake']:.4f} |",
                  flush=True)
