"""What filter pruning buys on transformers in ONNX Runtime: FP32 dense vs FP32 pruned vs
pruned + INT8 deploy, on a BERT-base-size encoder (12 layers, 768 wide, 12 heads, 3072 FFN,
128 tokens) and a ViT-B/16-size model (224x224, 197 tokens), random weights, batch 1.

``prune_ratio: 0.3`` (ascend_optimized) prunes whole attention heads and the FFN intermediate
dimension (targets on BERT-base: pruned >= 1.3x, pruned + INT8 >= 3x). Every model
is timed interleaved with the others (median of --runs, 2 intra-op threads), so a burst of load
hits all alike. Speed does not depend on training, so the clips are initialised on one batch.

Usage: python benchmarks/prune_speed.py [--models bert,vit] [--runs 30] [--ratio 0.3]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never the hub

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import openamct as amct  # noqa: E402
from openamct.export.ort_session import latency_ms, session  # noqa: E402
from openamct.export.writer import export_onnx, write_onnx  # noqa: E402

PRUNE = "prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: %s ascend_optimized: true } } }\n"
INT8 = ("retrain_data_quant_config { ulq_quantize { } }\n"
        "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n")


class Hidden(torch.nn.Module):
    """The encoder's last hidden state: one tensor output for every file."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).last_hidden_state


def build(name: str):
    import transformers as tf

    torch.manual_seed(0)
    if name == "bert":
        model = tf.BertModel(tf.BertConfig(attn_implementation="eager"), add_pooling_layer=False)
        x = torch.randint(0, 30522, (1, 128))
    elif name == "vit":
        model = tf.ViTModel(tf.ViTConfig(attn_implementation="eager"), add_pooling_layer=False)
        x = torch.randn(1, 3, 224, 224)
    else:
        raise SystemExit(f"unknown model {name!r}: bert or vit")
    return Hidden(model).eval(), x


def weights(model) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def run(name: str, ratio: float, runs: int, folder: str) -> dict:
    model, x = build(name)
    paths = {"fp32": os.path.join(folder, f"{name}_fp32.onnx")}
    write_onnx(export_onnx(model, x), paths["fp32"])
    shares = {}
    for label, text in (("pruned", PRUNE % ratio), ("pruned_int8", INT8 + PRUNE % ratio)):
        cfg, rec = os.path.join(folder, f"{label}.cfg"), os.path.join(folder, f"{name}_{label}.txt")
        with open(cfg, "w") as f:
            f.write(text)
        t0 = time.perf_counter()
        if label == "pruned":
            cm = amct.create_prune_retrain_model(model, x, cfg, rec)
        else:
            cm = amct.create_compressed_retrain_model(model, x, cfg, rec)
        with torch.no_grad():
            cm.eval()(x)  # initialises the activation clips
        prefix = os.path.join(folder, f"{name}_{label}")
        if label == "pruned":
            amct.save_prune_retrain_model(cm, prefix, x)
        else:
            amct.save_compressed_retrain_model(cm, rec, prefix, x)
        paths[label] = prefix + "_deploy_model.onnx"
        shares[label] = 1 - weights(cm) / weights(model)
        print(f"  {name} {label}: created and saved in {time.perf_counter() - t0:.1f} s, "
              f"{100 * shares[label]:.0f} % of the Linear weight removed", flush=True)
    lat = latency_ms({k: session(p) for k, p in paths.items()}, x.numpy(), runs=runs)
    return {"lat": lat, "share": shares["pruned"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bert,vit")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--ratio", type=float, default=0.3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="prune-speed-") as folder:
        for name in args.models.split(","):
            print(f"== {name}", flush=True)
            rows.append((name, run(name, args.ratio, args.runs, folder)))
    print("\n| model | weight removed | FP32 dense | FP32 pruned | pruned + INT8 | pruned speed-up | "
          "pruned + INT8 speed-up |\n|---|---|---|---|---|---|---|")
    for name, r in rows:
        lat = r["lat"]
        print(f"| {name} | {100 * r['share']:.0f} % | {lat['fp32']:.1f} ms | {lat['pruned']:.1f} ms | "
              f"{lat['pruned_int8']:.1f} ms | {lat['fp32'] / lat['pruned']:.2f}x | "
              f"{lat['fp32'] / lat['pruned_int8']:.2f}x |")


if __name__ == "__main__":
    main()
