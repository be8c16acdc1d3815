"""One zoo run: create -> a few SGD steps -> eval forward -> checkpoint -> restore (outputs
equal) -> save -> ONNX Runtime runs both files. Returns the figures the zoo table reports."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import torch

import openamct as amct
from openamct.compressed.layer import CompressedLayer

INT8 = ("retrain_data_quant_config { ulq_quantize { } }\n"
        "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n")
CONFIGS = {
    "int8": INT8,
    "2:4+int8": INT8 + "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 0 } } }\n",
    "filter0.3+int8": INT8 + ("prune_config { filter_pruner { balanced_l2_norm_filter_prune { "
                              "prune_ratio: 0.3 ascend_optimized: false } } }\n"),
}


def first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return next(v for v in out.values() if isinstance(v, torch.Tensor))
    return next(first_tensor(o) for o in out if isinstance(o, (torch.Tensor, dict, tuple, list)))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _train(model, inputs: dict, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        out = first_tensor(model(**inputs))
        loss = out.float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _ort(path: str, inputs: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feeds = {n: inputs[n].numpy() for n in names}
    return sess.run(None, feeds)[0]


def run(build, config: str, folder: str) -> dict:
    model, inputs = build()
    weights = {n: m.weight.numel() for n, m in model.named_modules()
               if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() >= 2}
    cfg = os.path.join(folder, "retrain.cfg")
    with open(cfg, "w") as f:
        f.write(config)
    rec, ckpt = os.path.join(folder, "record.txt"), os.path.join(folder, "ckpt.pth")
    c = amct.create_compressed_retrain_model(model, inputs, cfg, rec)
    _train(c, inputs)
    with torch.no_grad():
        ref = first_tensor(c(**inputs)).numpy()
    torch.save({"state_dict": c.state_dict()}, ckpt)
    fresh, _ = build()
    r = amct.restore_compressed_retrain_model(fresh, inputs, cfg, rec, ckpt, "state_dict")
    r.eval()
    with torch.no_grad():
        again = first_tensor(r(**inputs)).numpy()
    assert np.array_equal(ref, again), "restore is not exact"
    prefix = os.path.join(folder, "m")
    amct.save_compressed_retrain_model(r, rec, prefix, inputs)
    fake = _ort(prefix + "_fake_quant_model.onnx", inputs)
    deploy = _ort(prefix + "_deploy_model.onnx", inputs)
    layers = {n: m for n, m in r.named_modules() if isinstance(m, CompressedLayer)}
    before = sum(weights[n] for n in layers)
    return {
        "quantized": sum(m.act_quant is not None for m in layers.values()),
        "sparse": sum(m.sparsity is not None for m in layers.values()),
        "pruned": sum(m.weight.numel() < weights[n] for n, m in layers.items()),
        "removed_share": 1 - sum(m.weight.numel() for m in layers.values()) / max(before, 1),
        "fake_vs_torch": cosine(fake, ref), "deploy_vs_fake": cosine(deploy, fake),
    }
