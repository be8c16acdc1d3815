"""What ``quantize_activation_matmul`` costs all-MiniLM-L6-v2 before any training: INT8 (the
examples' minilm_int8.cfg) with the switch off and on, clips initialised on the same calibration
batches (``batch_num`` of them, training mode, no optimiser step), embeddings of held-out
standard-library sentences compared with the FP32 model's (examples/minilm_helpers.compare:
cosine per sentence, nearest-neighbour agreement). Runs in torch (the fake-quant model computes
what the deploy file does). Needs the ``examples`` extra.

Measured (4 batches of 32, 256 held-out sentences): off mean cosine 0.9911, min 0.9764, top-1
agreement 0.840, top-5 overlap 0.879; on 0.9907, 0.9747, 0.824, 0.882. A small loss before any
training, which is why the switch is off by default (QAT may recover it; not measured).

Usage: PYTHONPATH=. python benchmarks/attention_matmul_minilm.py [--calib 4] [--held-out 256]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import openamct as amct  # noqa: E402
from examples.minilm_helpers import (  # noqa: E402
    compare,
    embed,
    load_minilm,
    split_held_out,
    stdlib_sentences,
    tokenize,
)

CFG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "minilm_int8.cfg")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calib", type=int, default=4, help="calibration batches of 32 sentences (batch_num)")
    p.add_argument("--held-out", type=int, default=256)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    model, tok = load_minilm()
    train, held = split_held_out(stdlib_sentences())
    held = held[:args.held_out]
    batches = [tokenize(tok, train[i * 32:(i + 1) * 32]) for i in range(args.calib)]
    ref = embed(model, tok, held)
    with open(CFG, encoding="utf-8") as f:
        base = f.read() + f"batch_num: {args.calib}\n"
    with tempfile.TemporaryDirectory() as tmp:
        for tag, extra in (("matmul off", ""), ("matmul on", "quantize_activation_matmul: true\n")):
            cfg = os.path.join(tmp, "q.cfg")
            with open(cfg, "w") as f:
                f.write(base + extra)
            c = amct.create_compressed_retrain_model(model, batches[0], cfg, os.path.join(tmp, f"{tag[-2:]}.txt"))
            c.train()
            with torch.no_grad():
                for b in batches:
                    c(**b)
            r = compare(ref, embed(c, tok, held))
            print(f"{tag}: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
