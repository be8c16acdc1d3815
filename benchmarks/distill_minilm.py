"""Acceptance figures of the distillation API on all-MiniLM-L6-v2 (offline weights, the
example's stdlib sentences and held-out split; docs/distill.md).

    .venv/bin/python benchmarks/distill_minilm.py --out runs/distill_minilm
    .venv/bin/python benchmarks/distill_minilm.py --flows int8,int4 --steps 200

Flows (each: create -> distill -> save_distill_model -> deploy ONNX in ORT):

* ``int8``: create_distill_config + create_distill_model (INT8 weights per row, INT8 activations),
  then ``distill``;
* ``int4``: the same with ``dst_type: INT4`` weights (activations INT8);
* ``24aware``: create_compressed_retrain_model with 2:4 (data-aware masks, openamct's
  ``activation_aware_prune``) + INT8, then ``distill`` (the compressed-model recovery flow);
  ``24_int8``: the same with upstream's magnitude masks (``l1_selective_prune``).

Groups are found automatically (the 6 encoder layers, group_size 1). Each row: held-out mean
cosine to FP32 and top-1 nearest-neighbour agreement, PyTorch beside the deploy ONNX in ORT,
before and after distillation; ``metrics.json`` in ``--out``. Needs the ``examples`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never the hub

import numpy as np
import onnxruntime as ort
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import openamct as amct  # noqa: E402
from examples import minilm_helpers as minilm  # noqa: E402

NAMES, AXES = minilm.ONNX_INPUTS, minilm.ONNX_AXES
CFGS = {
    "int8": "distill_weight_quant_config { arq_distill { dst_type: INT8 channel_wise: true } }\n",
    "int4": "distill_weight_quant_config { arq_distill { dst_type: INT4 channel_wise: true } }\n",
}
# 2:4 + INT8 as examples/minilm_24_int8.cfg, the masks data-aware (openamct's extension) or
# from |w| (upstream's l1_selective_prune), decided over the first batch_num batches.
RETRAIN_24 = """batch_num: {batch_num}
retrain_data_quant_config {{ ulq_quantize {{ dst_type: INT8 }} }}
retrain_weight_quant_config {{ arq_retrain {{ dst_type: INT8 channel_wise: true }} }}
prune_config {{ n_out_of_m_pruner {{ {algo} {{ n_out_of_m_type: M4N2 }} }} }}
"""
ALGOS_24 = {"24aware": "activation_aware_prune", "24_int8": "l1_selective_prune"}
TARGETS = {"int8": 0.995, "int4": 0.98, "24aware": 0.975, "24_int8": 0.975}


def batches(tok, sentences, n: int, batch_size: int, seed: int) -> list[dict]:
    """``n`` length-bucketed batches of training sentences (the example's batching)."""
    gen = np.random.default_rng(seed)
    lengths = np.array([len(i) for i in tok(list(sentences), truncation=True, max_length=64)["input_ids"]])
    out: list[dict] = []
    while len(out) < n:
        for b in minilm._length_batches(lengths, batch_size, gen):
            out.append(minilm.tokenize(tok, [sentences[i] for i in b], 64))
            if len(out) == n:
                break
    return out


def run_flow(name, args, teacher, tok, train, held, ref) -> dict:
    out: dict = {"lr": args.lr[name]}
    sample = minilm.tokenize(tok, train[:32])
    cfg_json = os.path.join(args.out, f"{name}.json")
    t = time.perf_counter()
    if name in CFGS:
        cfg = os.path.join(args.out, f"{name}.cfg")
        with open(cfg, "w") as f:
            f.write(f"batch_num: {args.calib_batches}\n" + CFGS[name])
        amct.create_distill_config(cfg_json, teacher, sample, cfg)
        student = amct.create_distill_model(cfg_json, teacher, sample)
        record = cfg_json[:-5] + ".record"
    else:
        amct.create_distill_config(cfg_json, teacher, sample)  # for its groups only
        record = os.path.join(args.out, f"{name}.record")
        cfg = os.path.join(args.out, f"{name}.cfg")
        with open(cfg, "w") as f:
            f.write(RETRAIN_24.format(batch_num=args.calib_batches, algo=ALGOS_24[name]))
        student = amct.create_compressed_retrain_model(teacher, sample, cfg, record)
    steps = args.steps_24 if name.startswith("24") and args.steps_24 else args.steps
    out["steps"] = steps
    loader = batches(tok, train, steps, args.batch_size, args.seed)
    with torch.no_grad():  # clips (and 2:4 masks) from the first batches, as distill's calibration does
        for b in loader[:args.calib_batches]:
            student.eval()(**b)
    out["before"] = minilm.compare(ref, minilm.embed(student, tok, held))
    print(f"[{name}] created in {time.perf_counter() - t:.0f} s; before: cos {out['before']['mean_cosine']:.4f} "
          f"top1 {out['before']['top1_agreement']:.3f}", flush=True)
    t = time.perf_counter()
    amct.distill(teacher, student, cfg_json, loader, epochs=1, lr=args.lr[name])
    out["distill_s"] = time.perf_counter() - t
    emb = minilm.embed(student, tok, held)
    out["pytorch"] = minilm.compare(ref, emb)
    prefix = os.path.join(args.out, name)
    amct.save_distill_model(student, prefix, sample, record_file=record, input_names=NAMES,
                            output_names=["embedding"], dynamic_axes=AXES)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sess = ort.InferenceSession(prefix + "_deploy_model.onnx", so, providers=["CPUExecutionProvider"])
    out["onnx_deploy"] = minilm.compare(ref, minilm.embed_onnx(sess, tok, held))
    out["deploy_bytes"] = os.path.getsize(prefix + "_deploy_model.onnx")
    p, o = out["pytorch"], out["onnx_deploy"]
    print(f"[{name}] {steps} steps lr {args.lr[name]:g} in {out['distill_s']:.0f} s: PyTorch cos "
          f"{p['mean_cosine']:.4f} top1 {p['top1_agreement']:.3f} | ORT deploy cos {o['mean_cosine']:.4f} top1 "
          f"{o['top1_agreement']:.3f} [target {TARGETS[name]}]", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/distill_minilm")
    ap.add_argument("--flows", default="int8,int4,24aware")
    ap.add_argument("--calib-batches", type=int, default=4, help="batch_num: batches for clips and 2:4 masks")
    ap.add_argument("--steps", type=int, default=100, help="distillation batches per flow")
    ap.add_argument("--steps-24", type=int, default=None, help="distillation batches for the 2:4 flows")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr-int8", type=float, default=1e-5)
    ap.add_argument("--lr-int4", type=float, default=1e-4)
    ap.add_argument("--lr-24", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.lr = {"int8": args.lr_int8, "int4": args.lr_int4, "24aware": args.lr_24, "24_int8": args.lr_24}
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    teacher, tok = minilm.load_minilm()
    train, held = minilm.split_held_out(minilm.stdlib_sentences())
    ref = minilm.embed(teacher, tok, held)
    metrics = {"train_sentences": len(train), "held_out_sentences": len(held)}
    t0 = time.perf_counter()
    for name in args.flows.split(","):
        metrics[name] = run_flow(name, args, teacher, tok, train, held, ref)
    metrics["total_s"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"total {metrics['total_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
