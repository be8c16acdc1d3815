"""all-MiniLM-L6-v2 in ONNX Runtime at 8x128 tokens: FP32 ONNX vs openamct's deploy model vs
ORT's own INT8 (``quantize_dynamic``, and ``quantize_static`` calibrated on 256 training
sentences), measured interleaved, medians, printed ratios and cosine to FP32.

    .venv/bin/python benchmarks/minilm_speed.py                      # builds what it needs
    .venv/bin/python benchmarks/minilm_speed.py --deploy runs/minilm/minilm_24_int8_deploy_model.onnx
    .venv/bin/python benchmarks/minilm_speed.py --optimized-dir /tmp/ort-opt   # ORT's fused graphs

Without ``--deploy`` it compresses the model itself (INT8 only and 2:4 + INT8, the configs in
``examples/``), initialises the clips on one batch of real sentences and saves: speed does not
depend on training. Every model is exported the same way (TorchScript exporter, opset 17,
dynamic batch and sequence axes). The target is deploy >= 1.7x FP32.
Needs the ``examples`` extra.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never the hub

import numpy as np
import onnx
import onnxruntime as ort
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import openamct as amct  # noqa: E402
from examples import minilm_helpers as minilm  # noqa: E402
from openamct.export.writer import export_onnx, write_onnx  # noqa: E402

NAMES, AXES = minilm.ONNX_INPUTS, minilm.ONNX_AXES
CONFIGS = {"int8": os.path.join(ROOT, "examples", "minilm_int8.cfg"),
           "24_int8": os.path.join(ROOT, "examples", "minilm_24_int8.cfg")}
# What ORT turned the layers into: integer kernels vs float ones.
WATCH = ("MatMul", "Gemm", "FusedMatMul", "QGemm", "MatMulInteger", "MatMulIntegerToFloat",
         "DynamicQuantizeMatMul", "DynamicQuantizeLinear", "QLinearMatMul", "QuantizeLinear",
         "DequantizeLinear", "QAttention", "Attention", "SkipLayerNormalization", "LayerNormalization")


def long_texts(tokenizer, sentences: list[str], batch: int, tokens: int) -> dict[str, torch.Tensor]:
    """``batch`` rows of exactly ``tokens`` real tokens (consecutive sentences joined)."""
    rows, cur = [], []
    for s in sentences:
        cur.append(s)
        if len(tokenizer(" ".join(cur))["input_ids"]) >= tokens:
            rows.append(" ".join(cur))
            cur = []
            if len(rows) == batch:
                break
    b = minilm.tokenize(tokenizer, rows, max_length=tokens, pad_to_max=True)
    assert int(b["attention_mask"].sum()) == batch * tokens, "not enough text for full rows"
    return b


def session(path: str, threads: int, optimized: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if optimized:
        so.optimized_model_filepath = optimized
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def build_models(folder: str, which: list[str], deploy: str | None, model, tok, train: list[str]) -> dict[str, str]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    sample = minilm.tokenize(tok, train[:32])
    paths = {"fp32": os.path.join(folder, "fp32.onnx")}
    write_onnx(export_onnx(model, sample, NAMES, ["embedding"], AXES), paths["fp32"])
    paths["ort_dynamic_int8"] = os.path.join(folder, "ort_dynamic.onnx")
    quantize_dynamic(paths["fp32"], paths["ort_dynamic_int8"], weight_type=QuantType.QInt8)
    paths["ort_static_int8"] = os.path.join(folder, "ort_static.onnx")
    static_ptq(paths["fp32"], paths["ort_static_int8"], tok, train)
    if deploy:
        paths["openamct_deploy"] = deploy
        return paths
    for name in which:
        rec = os.path.join(folder, f"{name}.rec")
        cm = amct.create_compressed_retrain_model(model, sample, CONFIGS[name], rec)
        with torch.no_grad():
            cm.eval()(**sample)  # initialises the activation clips (and the 2:4 masks)
        prefix = os.path.join(folder, name)
        amct.save_compressed_retrain_model(cm, rec, prefix, sample, NAMES, ["embedding"], AXES)
        paths[f"openamct_{name}"] = prefix + "_deploy_model.onnx"
    return paths


def static_ptq(fp32: str, out: str, tok, sentences: list[str], batches: int = 8) -> None:
    """ORT's ``quantize_static`` as a user would run it: QDQ, uint8 activations, per-channel int8
    weights, MinMax ranges from ``batches`` x 32 training sentences (no training)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{k: v.numpy() for k, v in minilm.tokenize(tok, sentences[i:i + 32]).items()}
                               for i in range(0, 32 * batches, 32)])

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(fp32, out, Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, per_channel=True)


def op_counts(path: str) -> dict[str, int]:
    c = collections.Counter(n.op_type for n in onnx.load(path).graph.node)
    return {k: c[k] for k in WATCH if c[k]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deploy", help="an openamct deploy ONNX of the SentenceEncoder to measure "
                                     "(default: build INT8 and 2:4+INT8 ones here)")
    ap.add_argument("--configs", default="int8,24_int8", help="which of int8,24_int8 to build")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    ap.add_argument("--rounds", type=int, default=30, help="interleaved timed runs per model")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--work-dir", help="keep the ONNX models built here (default: a temporary folder)")
    ap.add_argument("--optimized-dir", help="write ORT's optimized graph of each model here and "
                                            "print which MatMul/Gemm became integer kernels")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="minilm-speed-") as tmp:
        if args.work_dir:
            os.makedirs(args.work_dir, exist_ok=True)
            tmp = args.work_dir
        t0 = time.perf_counter()
        model, tok = minilm.load_minilm()
        sentences = minilm.stdlib_sentences()
        train, held = minilm.split_held_out(sentences)
        paths = build_models(tmp, [c for c in args.configs.split(",") if c], args.deploy, model, tok, train)
        print(f"models built in {time.perf_counter() - t0:.0f} s")
        feed = {k: v.numpy() for k, v in long_texts(tok, sentences, args.batch,
                                                      args.tokens).items()}
        sessions = {}
        for name, path in paths.items():
            opt = os.path.join(args.optimized_dir, f"{name}.onnx") if args.optimized_dir else None
            if opt:
                os.makedirs(args.optimized_dir, exist_ok=True)
            sessions[name] = session(path, args.threads, opt)
            if opt:
                print(f"{name}: ORT optimized graph {opt}: {op_counts(opt)}")
        outs = {n: s.run(None, feed)[0] for n, s in sessions.items()}
        # Accuracy on what the model is for: single held-out sentences (never used to calibrate
        # or train), mean per-sentence cosine to the FP32 ONNX model's embeddings.
        held_emb = {n: minilm.embed_onnx(s, tok, held) for n, s in sessions.items()}
        held_cos = {n: float(torch.nn.functional.cosine_similarity(e, held_emb["fp32"], dim=-1).mean())
                    for n, e in held_emb.items()}
        for _ in range(args.warmup - 1):
            for s in sessions.values():
                s.run(None, feed)
        times: dict[str, list[float]] = {n: [] for n in sessions}
        for r in range(args.rounds):
            order = list(sessions) if r % 2 == 0 else list(sessions)[::-1]  # no fixed neighbour
            for n in order:
                # Each session owns a spinning 2-thread pool: let the previous one go idle first,
                # or it steals one of the 2 cores from whichever model runs next.
                time.sleep(0.05)
                t = time.perf_counter()
                sessions[n].run(None, feed)
                times[n].append(time.perf_counter() - t)

    base = statistics.median(times["fp32"])
    ref = outs["fp32"]
    print(f"\n{args.batch}x{args.tokens} tokens, ORT {ort.__version__}, {args.threads} intra-op threads, "
          f"{args.rounds} interleaved rounds (median, [p25, p75])")
    for n, ts in times.items():
        q = np.percentile(ts, [25, 75]) * 1e3
        cos = float(np.mean(np.sum(outs[n] * ref, -1) / np.linalg.norm(outs[n], axis=-1)
                            / np.linalg.norm(ref, axis=-1)))
        print(f"  {n:22s} {statistics.median(ts) * 1e3:8.1f} ms [{q[0]:.1f}, {q[1]:.1f}]  "
              f"speed-up x{base / statistics.median(ts):.2f}  cosine to FP32: these texts {cos:.4f}, "
              f"{len(held)} held-out sentences {held_cos[n]:.4f}")
    if not args.deploy:
        print("(openamct models built here are not distilled: their cosine is before training; "
              "examples/minilm_distill.py reports the trained ones)")


if __name__ == "__main__":
    main()
