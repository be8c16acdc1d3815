"""One zoo run: create -> a few SGD steps -> eval forward -> checkpoint -> restore (outputs
equal) -> save -> restore again from the record save left (outputs equal) -> ONNX Runtime runs
both files. Returns the figures the zoo table reports."""

from __future__ import annotations

import copy
import os

import numpy as np
import onnxruntime as ort
import torch

import openamct as amct
from openamct.compressed.attention import substitute_attention
from openamct.compressed.layer import CompressedLayer
from tests.runtimes import openvino_compile

INT8 = ("retrain_data_quant_config { ulq_quantize { } }\n"
        "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n")
CONFIGS = {
    "int8": INT8,
    "2:4+int8": INT8 + "prune_config { n_out_of_m_pruner { l1_selective_prune { update_freq: 0 } } }\n",
    "filter0.3+int8": INT8 + ("prune_config { filter_pruner { balanced_l2_norm_filter_prune { "
                              "prune_ratio: 0.3 ascend_optimized: false } } }\n"),
}


def int8_deploy_graph(model, inputs: dict, folder: str):
    """``model`` under the INT8 config, clips initialised by one training forward on ``inputs``,
    saved as ``folder/m_*``; ORT's optimised graph of the deploy file (``onnx.GraphProto``)."""
    import onnx

    cfg, rec = os.path.join(folder, "q.cfg"), os.path.join(folder, "rec.txt")
    with open(cfg, "w") as f:
        f.write(INT8)
    c = amct.create_compressed_retrain_model(model, inputs, cfg, rec)
    c.train()
    with torch.no_grad():
        c(**inputs)  # initialise the clips
    c.eval()
    amct.save_compressed_retrain_model(c, rec, os.path.join(folder, "m"), inputs)
    so = ort.SessionOptions()
    so.optimized_model_filepath = os.path.join(folder, "opt.onnx")
    so.log_severity_level = 3  # the "hardware specific optimizations" warning: we only read the graph
    ort.InferenceSession(os.path.join(folder, "m_deploy_model.onnx"), so, providers=["CPUExecutionProvider"])
    assert os.path.exists(so.optimized_model_filepath)
    return onnx.load(so.optimized_model_filepath).graph


def first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return next(v for v in out.values() if isinstance(v, torch.Tensor))
    return next(first_tensor(o) for o in out if isinstance(o, (torch.Tensor, dict, tuple, list)))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _train(model, inputs: dict, target: torch.Tensor, steps: int = 2, lr: float = 1e-3) -> None:
    """SGD towards the float model's output, as QAT recovers it, with the gradient norm clipped
    at 1, as QAT recipes do. Random-weight nets in training mode on a batch of 2 have gradient
    norms of 1e5 to 1e13, and the float model's own gradient grows 20x under 1e-6 relative
    weight noise (timm DLA); unclipped, one step at 1e-3 drove activation clips to the 1.2e-7
    floor (timm DLA, Res2Net) or to NaN (ReXNet, 2:4), and the runs then measured runtimes on
    collapsed grids, not openamct."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    model.train()
    for _ in range(steps):
        out = first_tensor(model(**inputs))
        loss = (out.float() - target).square().mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    model.eval()


def _ort(path: str, batches: list[dict]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return [sess.run(None, {n: b[n].numpy() for n in names})[0] for b in batches]


def _openvino(path: str, batches: list[dict]) -> list[np.ndarray]:
    """The same file in OpenVINO (users on Intel CPUs run our deploy files there)."""
    compiled = openvino_compile(path, threads=1)
    names = [next(n for n in i.get_names() if n in batches[0]) for i in compiled.inputs]
    return [compiled({n: b[n].numpy() for n in names})[compiled.outputs[0]] for b in batches]


def _batches(inputs: dict, n: int = 5) -> list[dict]:
    """The example inputs and n - 1 more like them (floats redrawn, token ids kept)."""
    g = torch.Generator().manual_seed(123)
    more = [{k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in inputs.items()}
            for _ in range(n - 1)]
    return [inputs, *more]


def self_vs_noise(model, batches: list[dict], rel: float = 1e-6) -> tuple[float, float]:
    """Cosine of ``model``'s outputs on ``batches`` (all of them as one vector, and the worst
    batch's) to its outputs on the same batches with every float input element, and every
    compressed layer's input, multiplied by (1 + ``rel`` x Gaussian noise).

    How chaotic the net is: where a noise that small already moves the output (a full-size random
    MobileNetV2 in FP32: 0.977, docs/dev/platform.md), another runtime's float accumulation order
    moves it as far, and a low cosine to torch says nothing about the export. In the zoo's small
    nets FP32 reads 1.0000 on every family; the compressed model is what varies (a noise that
    moves one activation across a quantizer's rounding midpoint moves it a whole step), so that
    is the model measured. The noise goes in before every layer, as a runtime's ulp differences
    do: on the model input alone, the first quantizer's grid absorbs it (timm Res2Net INT8 read
    1.00000 so, while one rounding flip in its first block grows to a cosine of 0.85 by the last
    stage). vision.check bounds fidelity only where this is high."""
    g = torch.Generator().manual_seed(7)

    def noisy(v):
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            return v
        return v * (1 + rel * torch.randn(v.shape, generator=g)).to(v.dtype)

    def perturb(module, args):
        return tuple(noisy(a) for a in args)

    with torch.no_grad():
        clean = [first_tensor(model(**b)).numpy().ravel() for b in batches]
        hooks = [m.register_forward_pre_hook(perturb) for m in model.modules() if isinstance(m, CompressedLayer)]
        try:
            moved = [first_tensor(model(**{k: noisy(v) for k, v in b.items()})).numpy().ravel() for b in batches]
        finally:
            for h in hooks:
                h.remove()
    return cosine(np.concatenate(clean), np.concatenate(moved)), min(cosine(a, b) for a, b in zip(clean, moved))


def weight_sizes(model) -> dict[str, int]:
    """Element count of every 2-D-or-more module weight, by module path (taken before create) in
    the compressed model's tree: nn.MultiheadAttention replaced as create does (its in_proj)."""
    model = copy.deepcopy(model)
    substitute_attention(model)
    return {n: m.weight.numel() for n, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() >= 2}


def removed_share(weights: dict[str, int], compressed) -> float:
    """Share of the compressed layers' weight that filter pruning removed."""
    layers = {n: m for n, m in compressed.named_modules() if isinstance(m, CompressedLayer)}
    return 1 - sum(m.weight.numel() for m in layers.values()) / max(sum(weights[n] for n in layers), 1)


def run(build, config: str, folder: str, lr: float = 1e-3) -> dict:
    """``lr``: the SGD steps' learning rate (``_train``)."""
    model, inputs = build()
    weights = weight_sizes(model)
    batches = _batches(inputs)
    cfg = os.path.join(folder, "retrain.cfg")
    with open(cfg, "w") as f:
        f.write(config)
    rec, ckpt = os.path.join(folder, "record.txt"), os.path.join(folder, "ckpt.pth")
    with torch.no_grad():
        target = first_tensor(model(**inputs)).float()
    c = amct.create_compressed_retrain_model(model, inputs, cfg, rec)
    _train(c, inputs, target, lr=lr)
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
    # The record as save left it restores the same model: a resumed job starts from that file.
    resumed = amct.restore_compressed_retrain_model(build()[0], inputs, cfg, rec, ckpt, "state_dict")
    resumed.eval()
    with torch.no_grad():
        assert np.array_equal(ref, first_tensor(resumed(**inputs)).numpy()), "restore from the saved record"
    del resumed
    conditioning, conditioning_min = self_vs_noise(r, batches)
    with torch.no_grad():
        refs = [first_tensor(r(**b)).numpy() for b in batches]
    fakes = _ort(prefix + "_fake_quant_model.onnx", batches)
    deploys = _ort(prefix + "_deploy_model.onnx", batches)
    openvino = _openvino(prefix + "_deploy_model.onnx", batches)
    fake_cos = sorted(cosine(f, t) for f, t in zip(fakes, refs))  # 5 batches
    layers = {n: m for n, m in r.named_modules() if isinstance(m, CompressedLayer)}
    return {
        "quantized": sum(m.act_quant is not None for m in layers.values()),
        "sparse": sum(m.sparsity is not None for m in layers.values()),
        "pruned": sum(m.weight.numel() < weights[n] for n, m in layers.items()),
        "removed_share": removed_share(weights, r),
        "self_vs_noise": conditioning,  # the compressed model against itself, 1e-6 noise at every layer
        "self_vs_noise_min": conditioning_min,  # (its worst batch)
        # median and worst of 5 input batches (why: tests/zoo/test_zoo.py)
        "fake_vs_torch": fake_cos[len(fake_cos) // 2], "fake_vs_torch_min": fake_cos[0],
        "deploy_vs_fake": float(np.median([cosine(d, f) for d, f in zip(deploys, fakes)])),
        "openvino_vs_fake": float(np.median([cosine(v, f) for v, f in zip(openvino, fakes)])),
    }
