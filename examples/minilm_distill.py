"""Compress a real pretrained transformer, all-MiniLM-L6-v2, with 2:4 sparsity + INT8 (or INT8
alone) and win its accuracy back by distillation from the FP32 model, on CPU, offline.

    pip install -e '.[examples]'
    .venv/bin/python examples/minilm_distill.py --out runs/minilm              # both configs
    .venv/bin/python examples/minilm_distill.py --config 24_int8 --steps 400

For each config (``examples/minilm_int8.cfg``, ``examples/minilm_24_int8.cfg``):

1. ``create_compressed_retrain_model`` on the Hugging Face model with keyword inputs
   (``{"input_ids", "attention_mask"}``): its 36 encoder ``nn.Linear`` get INT8 (+ 2:4).
2. One eval forward on real sentences initialises the activation clips (and 2:4 masks).
3. Distillation: the FP32 model is the teacher, the compressed model learns to reproduce its
   sentence embeddings and its per-layer hidden states on unlabeled English (docstrings of the
   Python standard library, split into sentences; held-out sentences never train).
4. ``save_compressed_retrain_model`` writes the fake-quant and the INT8 deploy ONNX; the deploy
   model then runs in ONNX Runtime with the tokenizer.
5. Evaluation on the held-out sentences: cosine between compressed and FP32 embeddings
   (PyTorch and ORT) and agreement of nearest-neighbour rankings; plus the FP32 sanity check
   cos("A man is eating food.", "A man is eating a piece of bread.") = 0.7553.

Files in ``--out``: ``<config>.record`` (AMCT record), ``<config>.pth`` (state dict of the
compressed model, for ``restore_compressed_retrain_model``), ``<config>_fake_quant_model.onnx``,
``<config>_deploy_model.onnx``, ``metrics.json``. Speed: ``benchmarks/minilm_speed.py
--deploy <out>/24_int8_deploy_model.onnx``. Background: docs/transformers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never the hub

import onnxruntime as ort
import torch

from openamct.compressed.layer import CompressedLayer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import openamct as amct  # noqa: E402
from examples import minilm_helpers as minilm  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {"int8": os.path.join(HERE, "minilm_int8.cfg"),
           "24_int8": os.path.join(HERE, "minilm_24_int8.cfg")}
TARGETS = {"int8": 0.98, "24_int8": 0.95}  # held-out mean cosine to FP32
NAMES, AXES = minilm.ONNX_INPUTS, minilm.ONNX_AXES


def fmt(m: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in m.items())


def run_config(name: str, steps: int, lr: float, args, teacher, tok, train, held, ref) -> dict:
    out = {"config": CONFIGS[name], "steps": steps, "lr": lr}
    record = os.path.join(args.out, f"{name}.record")
    sample = minilm.tokenize(tok, train[:args.batch_size])  # also the capture/export input
    t = time.perf_counter()
    student = amct.create_compressed_retrain_model(teacher, sample, CONFIGS[name], record)
    with torch.no_grad():
        student.eval()(**sample)  # clips from real sentences; 2:4 masks from |w|
    n_layers = sum(1 for m in student.modules() if isinstance(m, CompressedLayer))
    print(f"[{name}] {n_layers} compressed layers, created + initialised in {time.perf_counter() - t:.0f} s")
    out["before"] = minilm.compare(ref, minilm.embed(student, tok, held))
    print(f"[{name}] before distillation: {fmt(out['before'])}")

    t = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if step % 25 == 0 or step == steps - 1:
            el = time.perf_counter() - t
            print(f"[{name}] step {step + 1}/{steps} loss {loss:.4f} ({el / (step + 1):.2f} s/step)", flush=True)

    losses = minilm.distill(student, teacher, tok, train, steps, batch_size=args.batch_size,
                            lr=lr, hidden_weight=args.hidden_weight,
                            seed=args.seed, on_step=progress)
    out["train_s"], out["final_loss"] = time.perf_counter() - t, (losses[-1] if losses else None)
    emb = minilm.embed(student, tok, held)
    out["pytorch"] = minilm.compare(ref, emb)
    out["pair_cosine"] = minilm.pair_cosine(student, tok)
    print(f"[{name}] after {steps} steps ({out['train_s']:.0f} s), PyTorch: {fmt(out['pytorch'])}; "
          f"pair cosine {out['pair_cosine']:.4f}")
    torch.save(student.state_dict(), os.path.join(args.out, f"{name}.pth"))

    t = time.perf_counter()
    prefix = os.path.join(args.out, name)
    amct.save_compressed_retrain_model(student, record, prefix, sample, input_names=NAMES,
                                       output_names=["embedding"], dynamic_axes=AXES)
    print(f"[{name}] saved {prefix}_fake_quant_model.onnx and {prefix}_deploy_model.onnx "
          f"({time.perf_counter() - t:.0f} s)")
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    deploy = ort.InferenceSession(prefix + "_deploy_model.onnx", so, providers=["CPUExecutionProvider"])
    emb_ort = minilm.embed_onnx(deploy, tok, held)
    out["onnx_deploy"] = minilm.compare(ref, emb_ort)
    out["onnx_deploy_vs_pytorch"] = minilm.compare(emb, emb_ort)
    print(f"[{name}] deploy ONNX in ORT vs FP32: {fmt(out['onnx_deploy'])}")
    print(f"[{name}] deploy ONNX in ORT vs compressed PyTorch: {fmt(out['onnx_deploy_vs_pytorch'])}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/minilm", help="folder for records, checkpoints, ONNX, metrics")
    ap.add_argument("--config", choices=["both", *CONFIGS], default="both")
    ap.add_argument("--steps", type=int, default=600, help="distillation steps for 2:4 + INT8")
    ap.add_argument("--int8-steps", type=int, default=50, help="distillation steps for INT8 alone")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--hidden-weight", type=float, default=3.0,
                    help="weight of the per-block hidden-state MSE against the embedding cosine term")
    # INT8 alone starts at cosine 0.995 and only needs its clips and weights nudged: at the 2:4
    # learning rate it drifts away (0.995 -> 0.980 after 50 steps at 3e-4; 0.996 at 1e-5).
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate for 2:4 + INT8")
    ap.add_argument("--int8-lr", type=float, default=1e-5, help="learning rate for INT8 alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch and ORT intra-op threads")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()

    teacher, tok = minilm.load_minilm()
    pair = minilm.pair_cosine(teacher, tok)
    print(f"FP32 cos{minilm.PAIR} = {pair:.4f} (sentence-transformers: {minilm.PAIR_COSINE})")
    if abs(pair - minilm.PAIR_COSINE) > 0.002:
        raise SystemExit("the FP32 model does not reproduce the reference cosine: wrong weights or pooling")
    train, held = minilm.split_held_out(minilm.stdlib_sentences())
    print(f"corpus: {len(train)} training and {len(held)} held-out sentences from stdlib docstrings")
    ref = minilm.embed(teacher, tok, held)

    metrics = {"fp32_pair_cosine": pair, "train_sentences": len(train), "held_out_sentences": len(held)}
    names = list(CONFIGS) if args.config == "both" else [args.config]
    for name in names:
        steps, lr = (args.int8_steps, args.int8_lr) if name == "int8" else (args.steps, args.lr)
        metrics[name] = run_config(name, steps, lr, args, teacher, tok, train, held, ref)
    metrics["total_s"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)

    print(f"\nheld-out mean cosine to FP32 ({len(held)} sentences), target in brackets:")
    for name in names:
        m = metrics[name]
        ok = min(m["pytorch"]["mean_cosine"], m["onnx_deploy"]["mean_cosine"]) >= TARGETS[name]
        print(f"  {name:8s} PyTorch {m['pytorch']['mean_cosine']:.4f}  ORT deploy {m['onnx_deploy']['mean_cosine']:.4f}"
              f"  top-1 NN agreement {m['onnx_deploy']['top1_agreement']:.3f}  [>= {TARGETS[name]}] "
              f"{'ok' if ok else 'BELOW TARGET'}")
    print(f"total {metrics['total_s'] / 60:.1f} min; metrics in {os.path.join(args.out, 'metrics.json')}")


if __name__ == "__main__":
    main()
