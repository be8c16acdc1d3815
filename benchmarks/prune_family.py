"""amct.prune's figures, side by side in one run (docs/prune.md).

    .venv/bin/python benchmarks/prune_family.py minilm --steps 100    # about 3-5 min on 2 cores
    .venv/bin/python benchmarks/prune_family.py moe
    .venv/bin/python benchmarks/prune_family.py memory

* ``minilm``: all-MiniLM-L6-v2 (offline weights, the examples' stdlib sentences and held-out
  split), dense FFN pruning at 30 % and 50 %, ``low_variance`` vs ``reconstruct``: held-out mean
  cosine and top-1 neighbour agreement against FP32, right after pruning and after
  ``prune_finetune`` (``--steps``, against the FP32 model's embeddings). Needs the examples extra.
* ``moe``: a small random Mixtral (8 experts, top-2): experts removed at 50 % by each MoE method,
  the parameters left, and on held-out tokens the router's agreement with the original (the share
  of token-layer routings that pick the same experts) and the top-1 agreement of the logits.
* ``memory``: peak RSS of a tolerance search over a ~20M-parameter Llama, each mode in a fresh
  process: masks (``low_variance``) vs copies (``reconstruct``), as a multiple of the model's size.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never the hub

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import openamct as amct  # noqa: E402
from openamct.pruning import PruneReport  # noqa: E402


def _dense(method: str, ratio: float) -> dict:
    return {"methods": {"dense": {"name": method, "kwargs": {"prune_ratio": ratio}}}}


def minilm_rows(args) -> list[dict]:
    from examples import minilm_helpers as minilm

    fp32, tok = minilm.load_minilm()
    train, held = minilm.split_held_out(minilm.stdlib_sentences())
    held = held[: args.held]
    ref = minilm.embed(fp32, tok, held)
    calib = [minilm.tokenize(tok, train[i:i + 16], 64) for i in range(0, 16 * args.calib_batches, 16)]
    start = 16 * args.calib_batches  # finetuning batches follow the calibration sentences, cycling
    span = len(train) - start - args.batch
    tune = [minilm.tokenize(tok, train[start + (j * args.batch) % span:][: args.batch], 64) for j in range(args.steps)]
    rows = []
    for ratio in (0.3, 0.5):
        for method in ("low_variance", "reconstruct"):
            model = copy.deepcopy(fp32)
            t = time.perf_counter()
            rep = PruneReport()
            amct.prune(model.bert, _dense(method, ratio), data=calib, report=rep)
            prune_s = time.perf_counter() - t
            before = minilm.compare(ref, minilm.embed(model, tok, held))
            t = time.perf_counter()
            amct.prune_finetune(model, tune, steps=args.steps, lr=args.lr, teacher=fp32)
            after = minilm.compare(ref, minilm.embed(model, tok, held))
            rows.append({"ratio": ratio, "method": method, "width": model.bert.config.intermediate_size,
                         "params": f"{rep.params_before / 1e6:.2f}M -> {rep.params_after / 1e6:.2f}M",
                         "prune_s": round(prune_s, 1), "finetune_s": round(time.perf_counter() - t, 1),
                         "cos_before": before["mean_cosine"], "nn_before": before["top1_agreement"],
                         "cos_after": after["mean_cosine"], "nn_after": after["top1_agreement"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def moe_rows(args) -> list[dict]:
    import transformers as T

    torch.manual_seed(0)
    cfg = T.MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    base = T.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in base.named_parameters():
            if n.endswith("gate.weight"):
                p.normal_(0, 0.5)
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, 512, (4, 32), generator=g) for _ in range(8)]
    held = [torch.randint(0, 512, (4, 32), generator=g) for _ in range(4)]

    def routes(model):
        got = []
        hs = [m.gate.register_forward_hook(lambda _m, _a, out: got.append(out[2].sort(-1).values))
              for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        with torch.no_grad():
            logits = [model(x).logits.argmax(-1) for x in held]
        for h in hs:
            h.remove()
        return got, logits

    ref_routes, ref_top1 = routes(base)
    rows = []
    presets = {"activation_count": {"name": "activation_count", "kwargs": {"prune_ratio": 0.5}},
               "mass_variance (boundary -1)": {"name": "mass_variance", "kwargs": {"prune_ratio": 0.5, "boundary": -1}},
               "output_merge": {"name": "output_merge", "kwargs": {"keep_ratio": 0.5}}}
    for label, spec in presets.items():
        model = copy.deepcopy(base)
        rep = PruneReport()
        amct.prune(model, {"methods": {"moe": spec}}, data=calib, report=rep)
        kept = [torch.tensor(sorted(set(range(8)) - set())) for _ in range(4)]
        got_routes, top1 = routes(model)
        # map the pruned model's expert indices back to the original's, layer by layer
        keep_idx = []
        for layer in range(4):
            w0 = base.model.layers[layer].mlp.gate.weight
            w1 = model.model.layers[layer].mlp.gate.weight
            keep_idx.append(torch.tensor([int((w0 - r).abs().sum(-1).argmin()) for r in w1]))
        del kept
        same = total = 0
        for i, (a, b) in enumerate(zip(ref_routes, got_routes)):
            mapped = keep_idx[i % 4][b].sort(-1).values
            same += int((mapped == a).all(-1).sum())
            total += a.shape[0]
        agree = sum(int((x == y).sum()) for x, y in zip(top1, ref_top1)) / sum(x.numel() for x in ref_top1)
        rows.append({"method": label, "experts": f"8 -> {model.config.num_local_experts}",
                     "params": f"{rep.params_before / 1e6:.2f}M -> {rep.params_after / 1e6:.2f}M",
                     "router_agreement": same / total, "logits_top1_agreement": agree,
                     "merged_layers": sum(e.detail == "merge" for e in rep.events if e.stage == "recover")})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def memory_child(mode: str) -> None:
    import transformers as T

    method = {"masks": "low_variance", "copies": "reconstruct"}[mode]
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 2000, (2, 32), generator=g) for _ in range(4)]
    # the same search on a small model first: the first use of a kernel (float64 GEMM, LAPACK)
    # maps library code into the process, which RSS counts; what is measured is then data only
    small = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=2000, hidden_size=64, intermediate_size=256,
                                             num_hidden_layers=1, num_attention_heads=4)).eval()
    amct.prune(small, _dense(method, 0.5), data=data, tolerance=1.0, ratio_grid=[0.2, 0.4, 0.6])
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=2000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=8)
    model = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for x in data:
            model(x)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rep = PruneReport()
    amct.prune(model, _dense(method, 0.5), data=data, tolerance=1.0, ratio_grid=[0.2, 0.4, 0.6], report=rep)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"mode": mode, "method": method, "model_mb": size / 2**20, "before_mb": start / 2**20,
                      "peak_mb": peak / 2**20, "growth_x_model": (peak - start) / size, "chosen": rep.chosen_ratio}))


def memory_rows(_args) -> list[dict]:
    rows = []
    for mode in ("masks", "copies"):
        out = subprocess.run([sys.executable, __file__, "memory-child", mode], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONPATH": ROOT})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["minilm", "moe", "memory", "memory-child"])
    ap.add_argument("mode", nargs="?", help="memory-child only: masks | copies")
    ap.add_argument("--steps", type=int, default=100, help="prune_finetune steps (minilm)")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--calib-batches", type=int, default=8)
    ap.add_argument("--held", type=int, default=400, help="held-out sentences compared (minilm)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.what == "memory-child":
        memory_child(args.mode)
        return
    rows = {"minilm": minilm_rows, "moe": moe_rows, "memory": memory_rows}[args.what](args)
    print(json.dumps({"what": args.what, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
