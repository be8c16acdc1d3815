"""INT4 deploy storage for all-MiniLM-L6-v2 in ONNX Runtime: MatMulNBits (com.microsoft) vs
opset-21 DequantizeLinear int4, beside the INT8 deploy model and FP32 (docs/distill.md).

    .venv/bin/python benchmarks/int4_deploy_speed.py [--rounds 20]

Builds (no training: speed does not depend on it) an INT4-weight + INT8-activation student with
create_distill_model, saves it once with the weights left in 8-bit storage, writes the two 4-bit
variants (``openamct.distill.int4_deploy.pack_int4_weights``), an INT8 deploy model and the FP32
ONNX, then times them interleaved in one process (8 sentences x 128 tokens, medians) and prints
file size, median latency and cosine to FP32. Needs the ``examples`` extra.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import onnx
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import openamct as amct  # noqa: E402
from benchmarks.minilm_speed import AXES, NAMES, long_texts, session  # noqa: E402
from examples import minilm_helpers as minilm  # noqa: E402
from openamct import pipeline  # noqa: E402
from openamct.distill.int4_deploy import pack_int4_weights  # noqa: E402
from openamct.export.writer import export_onnx, write_onnx  # noqa: E402


def student(folder: str, name: str, wtype: str, model, sample) -> str:
    """Raw deploy ONNX (INT4 values in int8 storage for INT4) of an uncalibrated-but-initialised student."""
    if os.path.isfile(os.path.join(folder, f"{name}_deploy_model.onnx")):  # --work-dir of an earlier run
        return os.path.join(folder, f"{name}_deploy_model.onnx")
    cfg, js = os.path.join(folder, f"{name}.cfg"), os.path.join(folder, f"{name}.json")
    with open(cfg, "w") as f:
        f.write(f"distill_weight_quant_config {{ arq_distill {{ dst_type: {wtype} channel_wise: true }} }}\n")
    amct.create_distill_config(js, model, sample, cfg)
    s = amct.create_distill_model(js, model, sample)
    with torch.no_grad():
        s.eval()(**sample)
    _, deploy = pipeline.save(s, os.path.join(folder, name), sample, None, NAMES, ["embedding"], AXES)
    return deploy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work-dir", help="keep the models here; models already there are reused")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.work_dir or tempfile.mkdtemp(prefix="int4-speed-")
    model, tok = minilm.load_minilm()
    train, _ = minilm.split_held_out(minilm.stdlib_sentences())
    sample = minilm.tokenize(tok, train[:32])
    paths = {"fp32": os.path.join(folder, "fp32.onnx")}
    if not os.path.isfile(paths["fp32"]):
        write_onnx(export_onnx(model, sample, NAMES, ["embedding"], AXES), paths["fp32"])
    paths["int8_deploy"] = student(folder, "int8", "INT8", model, sample)
    raw = student(folder, "int4", "INT4", model, sample)
    paths["int4_int8_storage"] = raw
    for fmt, level in (("matmulnbits", 0), ("matmulnbits_acc4", 4), ("dq_int4", 0)):
        proto = onnx.load(raw)
        n = pack_int4_weights(proto, fmt.removesuffix("_acc4"), accuracy_level=level)
        paths[f"int4_{fmt}"] = os.path.join(folder, f"int4_{fmt}.onnx")
        onnx.save(proto, paths[f"int4_{fmt}"])
        print(f"{fmt}: {n} Linear weights rewritten")
    feed = {k: v.numpy() for k, v in long_texts(tok, train, 8, 128).items()}
    sessions = {k: session(p, args.threads) for k, p in paths.items()}
    ref = sessions["fp32"].run(None, feed)[0]
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(3):
        for s in sessions.values():
            s.run(None, feed)
    for _ in range(args.rounds):  # interleaved: each round runs every model once
        for k, s in sessions.items():
            t = time.perf_counter()
            s.run(None, feed)
            times[k].append(time.perf_counter() - t)
    base = statistics.median(times["fp32"])
    print(f"{'model':22s} {'MB':>7s} {'median ms':>10s} {'vs FP32':>8s} {'cos FP32':>9s}")
    for k, s in sessions.items():
        out = s.run(None, feed)[0]
        cos = float(np.mean(np.sum(out * ref, -1) / np.linalg.norm(out, axis=-1) / np.linalg.norm(ref, axis=-1)))
        med = statistics.median(times[k])
        print(f"{k:22s} {os.path.getsize(paths[k]) / 1e6:7.2f} {1e3 * med:10.1f} {base / med:7.2f}x {cos:9.4f}")


if __name__ == "__main__":
    main()
