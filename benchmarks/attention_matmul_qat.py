"""What ``quantize_activation_matmul`` costs after the same short QAT, and what it buys in deploy
latency: all-MiniLM-L6-v2 (offline weights) and small torchvision ViT and Swin (random weights),
each compressed twice from the same FP32 model, switch off and on, clips initialised on the same
batches, then trained the same steps against the FP32 model's outputs (knowledge distillation,
AdamW; MiniLM: ``examples.minilm_helpers.distill``, embedding cosine + per-layer MSE).

Agreement with FP32, on held-out inputs, before and after QAT:
- MiniLM: embeddings of held-out standard-library sentences (``minilm_helpers.compare``: mean
  cosine per sentence, nearest-neighbour top-1 agreement);
- ViT / Swin: logits of held-out scikit-learn digits (8x8, upsampled to 32x32, 3 channels):
  mean cosine per row and top-1 agreement with the FP32 model.
Deploy latency: FP32 export, ``quantize_static`` (QDQ, uint8 activations, per-channel int8
weights, calibrated on the same batches; every MatMul quantized) and the two deploy files, in
ONNX Runtime (2 threads, no spinning), interleaved rounds in alternating order, ``--repeat``
fresh-session repeats; the medians and the median of the paired ratios are printed.

Measured (Intel Xeon, 2 cores shared at load 7-11, ORT 1.32; ViT: ``--steps 40 --repeat 3``,
MiniLM: ``--steps 20 --repeat 2``), cosine / top-1 after QAT, deploy / quantize_static latency:
ViT off 0.9966 / 0.997, 0.284; on 0.9971 / 0.997, 0.269. MiniLM off 0.9932 / 0.891, 0.615;
on 0.9927 / 0.859, 0.718. Swin (``--steps 20``) off 0.9916 / 0.879, 0.623; on 0.9923 / 0.845,
0.581 (docs/config.md has the table and the decision).

Usage: PYTHONPATH=. python benchmarks/attention_matmul_qat.py [--only minilm,vit,swin]
       [--steps 40] [--repeat 3] [--runs 10]      (about 10 min on 2 shared cores)
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never the hub

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import openamct as amct  # noqa: E402
from benchmarks.deploy_speed import QUANT_CFG, export_fp32, quantize_static  # noqa: E402
from openamct.export.ort_session import latency_ms, session  # noqa: E402

SWITCH = "quantize_activation_matmul: true\n"


def _vision(name: str) -> torch.nn.Module:
    """Random weights, re-initialised fan-in as the zoo does (torchvision's ViT head starts at
    zero: its logits would be all zero)."""
    from tests.zoo.families import reinitialise
    from tests.zoo.torchvision_ops import vision_modules

    tv, _ = vision_modules()
    torch.manual_seed(0)
    if name == "vit":
        model = tv.models.VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4, hidden_dim=128,
                                            mlp_dim=256, num_classes=10)
    else:
        from torchvision.models.swin_transformer import SwinTransformer

        model = SwinTransformer(patch_size=[2, 2], embed_dim=48, depths=[2, 2, 2], num_heads=[2, 4, 8],
                                window_size=[4, 4], num_classes=10)
    reinitialise(model, {"x": torch.randn(2, 3, 32, 32)})
    return model.eval()


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) real 8x8 digits as 3x32x32 images, standardised."""
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images, dtype=torch.float32)[:, None]
    x = F.interpolate(x, size=32, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x - x.mean()) / x.std()
    g = torch.Generator().manual_seed(0)
    x = x[torch.randperm(len(x), generator=g)]
    return x[:1500], x[1500:]


def _agree(ref: torch.Tensor, out: torch.Tensor) -> dict:
    cos = F.cosine_similarity(ref, out, dim=1)
    return {"mean_cosine": float(cos.mean()), "top1_agreement": float((ref.argmax(1) == out.argmax(1)).float().mean())}


def _qat_vision(c: torch.nn.Module, teacher: torch.nn.Module, train: torch.Tensor, steps: int) -> None:
    opt = torch.optim.AdamW([p for p in c.parameters() if p.requires_grad], lr=2e-4)
    c.train()
    for i in range(steps):
        xb = train[(i * 32) % (len(train) - 32):][:32]
        with torch.no_grad():
            target = teacher(xb)
        loss = F.mse_loss(c(xb), target) / target.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    c.eval()


def vision_row(name: str, steps: int, folder: str, calib_n: int) -> dict:
    model = _vision(name)
    train, held = _digits()
    with torch.no_grad():
        ref = model(held)
    calib = [train[i * 16:(i + 1) * 16] for i in range(calib_n)]
    fp32 = os.path.join(folder, f"{name}_fp32.onnx")
    export_fp32(model, held[:1], fp32)
    paths = {"fp32": fp32, "quantize_static": quantize_static(fp32, os.path.join(folder, f"{name}_qs.onnx"), calib)}
    rows = {}
    for tag, extra in (("off", ""), ("on", SWITCH)):
        cfg, rec = os.path.join(folder, f"{name}_{tag}.cfg"), os.path.join(folder, f"{name}_{tag}.txt")
        with open(cfg, "w") as f:
            f.write(QUANT_CFG + f"batch_num: {calib_n}\n" + extra)
        c = amct.create_compressed_retrain_model(copy.deepcopy(model), calib[0], cfg, rec)
        c.train()
        with torch.no_grad():
            for xb in calib:
                c(xb)
        c.eval()
        with torch.no_grad():
            before = _agree(ref, c(held))
        _qat_vision(c, model, train, steps)
        with torch.no_grad():
            after = _agree(ref, c(held))
        prefix = os.path.join(folder, f"{name}_{tag}")
        amct.save_compressed_retrain_model(c, rec, prefix, held[:1], input_names=["x"])
        paths[f"openamct {tag}"] = prefix + "_deploy_model.onnx"
        rows[tag] = (before, after)
    return {"rows": rows, "paths": paths, "feeds": held[:1].numpy()}


def minilm_row(steps: int, folder: str, calib_n: int) -> dict:
    from benchmarks.minilm_speed import long_texts, static_ptq
    from examples import minilm_helpers as minilm
    from openamct.export.writer import export_onnx, write_onnx

    model, tok = minilm.load_minilm()
    train, held = minilm.split_held_out(minilm.stdlib_sentences())
    held = held[:256]
    ref = minilm.embed(model, tok, held)
    batches = [minilm.tokenize(tok, train[i * 32:(i + 1) * 32]) for i in range(calib_n)]
    names, axes = minilm.ONNX_INPUTS, minilm.ONNX_AXES
    paths = {"fp32": os.path.join(folder, "minilm_fp32.onnx")}
    write_onnx(export_onnx(model, batches[0], names, ["embedding"], axes), paths["fp32"])
    paths["quantize_static"] = os.path.join(folder, "minilm_qs.onnx")
    static_ptq(paths["fp32"], paths["quantize_static"], tok, train)
    base_cfg = open(os.path.join(ROOT, "examples", "minilm_int8.cfg"), encoding="utf-8").read()
    rows = {}
    for tag, extra in (("off", ""), ("on", SWITCH)):
        cfg, rec = os.path.join(folder, f"minilm_{tag}.cfg"), os.path.join(folder, f"minilm_{tag}.txt")
        with open(cfg, "w") as f:
            f.write(base_cfg + f"batch_num: {calib_n}\n" + extra)
        c = amct.create_compressed_retrain_model(model, batches[0], cfg, rec)
        c.train()
        with torch.no_grad():
            for b in batches:
                c(**b)
        before = minilm.compare(ref, minilm.embed(c, tok, held))
        minilm.distill(c, model, tok, train, steps, batch_size=16, lr=5e-5)
        after = minilm.compare(ref, minilm.embed(c, tok, held))
        prefix = os.path.join(folder, f"minilm_{tag}")
        amct.save_compressed_retrain_model(c, rec, prefix, batches[0], names, ["embedding"], axes)
        paths[f"openamct {tag}"] = prefix + "_deploy_model.onnx"
        rows[tag] = (before, after)
    feeds = {k: v.numpy() for k, v in long_texts(tok, train, 1, 128).items()}
    return {"rows": rows, "paths": paths, "feeds": feeds}


def timing(paths: dict, feeds, runs: int, repeat: int) -> tuple[dict, dict]:
    reps = []
    for _ in range(repeat):
        sessions = {k: session(p) for k, p in paths.items()}
        reps.append(latency_ms(sessions, feeds, runs=runs, min_s=1.0))
    med = {k: float(np.median([r[k] for r in reps])) for k in reps[0]}
    ratios = {tag: float(np.median([r[f"openamct {tag}"] / r["quantize_static"] for r in reps])) for tag in ("off", "on")}
    return med, ratios


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="minilm,vit,swin")
    p.add_argument("--steps", type=int, default=40, help="QAT steps (the same for both)")
    p.add_argument("--calib", type=int, default=4, help="calibration batches (batch_num)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    unknown = set(args.only.split(",")) - {"minilm", "vit", "swin"}
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}")
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(2)
    from tests.zoo.torchvision_ops import vision_modules

    vision_modules()  # first: transformers imports torchvision where it finds it, which needs its ops declared
    print("| model | switch | cosine before QAT | top-1 before | cosine after QAT | top-1 after | deploy ms "
          "| deploy / quantize_static | FP32 ms | quantize_static ms |\n|---|---|---|---|---|---|---|---|---|---|",
          flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for name in args.only.split(","):
            r = minilm_row(args.steps, folder, args.calib) if name == "minilm" else \
                vision_row(name, args.steps, folder, args.calib)
            med, ratios = timing(r["paths"], r["feeds"], args.runs, args.repeat)
            for tag, (before, after) in r["rows"].items():
                print(f"| {name} | {tag} | {before['mean_cosine']:.4f} | {before['top1_agreement']:.3f} | "
                      f"{after['mean_cosine']:.4f} | {after['top1_agreement']:.3f} | {med[f'openamct {tag}']:.2f} | "
                      f"{ratios[tag]:.3f} | {med['fp32']:.2f} | {med['quantize_static']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
