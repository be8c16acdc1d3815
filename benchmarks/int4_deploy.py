"""A8W4 against A8W8 deploy files from the graph flow: file size and latency, side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/int4_deploy.py [--rounds 15] [--threads 2]

Two models, random weights where no trained ones are offline (speed does not depend on them):
a torchvision ResNet-18 (batch 8, 224x224) and all-MiniLM-L6-v2 (trained weights, offline;
8 rows x 128 tokens). Each is quantized with ``create_compressed_retrain_model`` under an INT8
config and under the same config with ``dst_type: INT4`` on the weights, calibrated by one
training forward, and saved. The deploy files are timed in one process, interleaved (each
round runs every file once, the order reversed every other round), medians; the FP32 export is
the reference for speed. ONNX Runtime, and OpenVINO's CPU plugin where it is installed.

Variants besides the two deploy files:
- ``a8w4_acc4``: the A8W4 file with ``MatMulNBits``' ``accuracy_level`` 4 (ORT quantizes the
  activations per block to int8 and uses its int8 kernels) instead of 0 (float math);
- ``a8w4_int8_storage`` (ResNet-18): the A8W4 grid kept in int8 initializers (the deploy form
  before INT4 storage), which ORT runs with its int8 QLinearConv.

``--quality STEPS``: instead, all-MiniLM-L6-v2 trained through the graph flow
(``create_compressed_retrain_model``) for STEPS steps against the FP32 model (embedding cosine +
per-layer hidden-state loss, ``examples/minilm_helpers.distill``) under A8W8 and three A8W4
configs (weights per tensor, per output channel, per channel with learned ULQ scales), then the
mean cosine of held-out sentence embeddings to FP32.
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
from openamct.export.writer import export_onnx, write_onnx  # noqa: E402

CFG = ("retrain_data_quant_config {{ ulq_quantize {{ }} }}\n"
       "retrain_weight_quant_config {{ arq_retrain {{ dst_type: {w} }} }}\n")
QUALITY = {  # name -> weight block of the config (the order they run in)
    "a8w4_per_channel": "arq_retrain { dst_type: INT4 channel_wise: true }",
    "a8w4_per_tensor": "arq_retrain { dst_type: INT4 }",
    "a8w4_per_channel_ulq": "ulq_retrain { dst_type: INT4 channel_wise: true }",
    "a8w8": "arq_retrain { }",
}


def quantized(folder: str, name: str, wtype: str, model, sample, names=None, axes=None, out="out") -> str:
    """The deploy file of ``model`` under A8W8 / A8W4 (one calibrating forward, no training)."""
    cfg = os.path.join(folder, f"{name}.cfg")
    with open(cfg, "w") as f:
        f.write(CFG.format(w=wtype))
    args = sample if isinstance(sample, tuple) else (sample,)
    m = amct.create_compressed_retrain_model(model, sample, cfg, os.path.join(folder, f"{name}.txt"))
    with torch.no_grad():
        m.train()
        m(**sample) if isinstance(sample, dict) else m(*args)
    m.eval()
    prefix = os.path.join(folder, name)
    amct.save_compressed_retrain_model(m, os.path.join(folder, f"{name}.txt"), prefix, sample,
                                       input_names=names, output_names=[out], dynamic_axes=axes)
    return prefix + "_deploy_model.onnx"


def with_accuracy_level(src: str, dst: str, level: int) -> str:
    proto = onnx.load(src)
    for n in proto.graph.node:
        if n.op_type == "MatMulNBits":
            for a in n.attribute:
                if a.name == "accuracy_level":
                    a.i = level
    onnx.save(proto, dst)
    return dst


def int8_storage(src: str, dst: str) -> str:
    """``src`` with its INT4 DequantizeLinear initializers stored as int8 (same values)."""
    proto = onnx.load(src)
    for t in proto.graph.initializer:
        if t.data_type == onnx.TensorProto.INT4:
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.int8), t.name))
    onnx.save(proto, dst)
    return dst


def timed(paths: dict[str, str], feed: dict, rounds: int, threads: int, openvino: bool) -> None:
    runs = {}
    for k, p in paths.items():
        runs[("ORT", k)] = session(p, threads)
        if openvino:
            from benchmarks.openvino_session import OpenVINOSession

            try:
                runs[("OpenVINO", k)] = OpenVINOSession(p, threads)
            except Exception as exc:  # (a runtime that cannot read a file is a result too)
                print(f"OpenVINO cannot compile {k}: {str(exc).splitlines()[0][:120]}")
    times: dict = {k: [] for k in runs}
    order = list(runs)
    for _ in range(2):
        for s in runs.values():
            s.run(None, feed)
    for r in range(rounds):  # interleaved, the order reversed every other round
        for k in (order if r % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            runs[k].run(None, feed)
            times[k].append(time.perf_counter() - t)
    print(f"{'runtime':9s} {'model':20s} {'MB':>7s} {'median ms':>10s} {'vs FP32':>8s} {'vs A8W8':>8s} {'cos FP32':>9s}")
    for (rt, k), s in runs.items():
        ref = runs[(rt, "fp32")].run(None, feed)[0]
        out = s.run(None, feed)[0].reshape(ref.shape[0], -1)
        ref = ref.reshape(ref.shape[0], -1)
        cos = float(np.mean(np.sum(out * ref, -1) / np.linalg.norm(out, axis=-1) / np.linalg.norm(ref, axis=-1)))
        med = statistics.median(times[(rt, k)])
        print(f"{rt:9s} {k:20s} {os.path.getsize(paths[k]) / 1e6:7.2f} {1e3 * med:10.1f} "
              f"{statistics.median(times[(rt, 'fp32')]) / med:7.2f}x "
              f"{statistics.median(times[(rt, 'a8w8')]) / med:7.2f}x {cos:9.4f}")


def resnet(folder: str, args) -> None:
    from tests.zoo.torchvision_ops import vision_modules

    torchvision, _ = vision_modules()  # from .venv/zoo-site (see that module)
    torch.manual_seed(0)
    x = torch.randn(8, 3, 224, 224)
    make = lambda: torchvision.models.resnet18(weights=None).eval()  # noqa: E731
    paths = {"fp32": os.path.join(folder, "resnet_fp32.onnx")}
    write_onnx(export_onnx(make(), x, ["x"], ["out"]), paths["fp32"])
    paths["a8w8"] = quantized(folder, "resnet_a8w8", "INT8", make(), x, ["x"])
    paths["a8w4"] = quantized(folder, "resnet_a8w4", "INT4", make(), x, ["x"])
    paths["a8w4_acc4"] = with_accuracy_level(paths["a8w4"], os.path.join(folder, "resnet_acc4.onnx"), 4)
    paths["a8w4_int8_storage"] = int8_storage(paths["a8w4"], os.path.join(folder, "resnet_int8st.onnx"))
    print(f"\nResNet-18, batch 8, 224x224, {args.threads} threads, {args.rounds} rounds")
    timed(paths, {"x": x.numpy()}, args.rounds, args.threads, args.openvino)


def minilm_rows(folder: str, args) -> None:
    from examples import minilm_helpers as minilm

    model, tok = minilm.load_minilm()
    train, _ = minilm.split_held_out(minilm.stdlib_sentences())
    sample = dict(minilm.tokenize(tok, train[:16]))
    paths = {"fp32": os.path.join(folder, "minilm_fp32.onnx")}
    write_onnx(export_onnx(model, sample, NAMES, ["embedding"], AXES), paths["fp32"])
    paths["a8w8"] = quantized(folder, "minilm_a8w8", "INT8", model, sample, NAMES, AXES, "embedding")
    paths["a8w4"] = quantized(folder, "minilm_a8w4", "INT4", model, sample, NAMES, AXES, "embedding")
    paths["a8w4_acc4"] = with_accuracy_level(paths["a8w4"], os.path.join(folder, "minilm_acc4.onnx"), 4)
    feed = {k: v.numpy() for k, v in long_texts(tok, train, 8, 128).items()}
    print(f"\nall-MiniLM-L6-v2, 8 x 128 tokens, {args.threads} threads, {args.rounds} rounds")
    timed(paths, feed, args.rounds, args.threads, args.openvino)


def quality(folder: str, steps: int, configs: list[str]) -> None:
    import copy

    from examples import minilm_helpers as minilm

    model, tok = minilm.load_minilm()
    train, held = minilm.split_held_out(minilm.stdlib_sentences())
    sample = dict(minilm.tokenize(tok, train[:16]))
    ref = minilm.embed(model, tok, held)
    print(f"\nall-MiniLM-L6-v2, {steps} training steps through the graph flow, {len(held)} held-out sentences")
    print(f"{'config':22s} {'held-out cos':>12s} {'min cos':>8s} {'top-1':>6s} {'minutes':>8s}")
    for name, wblock in QUALITY.items():
        if configs and name not in configs:
            continue
        cfg = os.path.join(folder, f"{name}.cfg")
        with open(cfg, "w") as f:
            f.write(f"retrain_data_quant_config {{ ulq_quantize {{ }} }}\nretrain_weight_quant_config {{ {wblock} }}\n")
        t = time.perf_counter()
        torch.manual_seed(0)
        student = amct.create_compressed_retrain_model(copy.deepcopy(model), sample, cfg,
                                                       os.path.join(folder, f"{name}.txt"))
        minilm.distill(student, model, tok, train, steps)
        c = minilm.compare(ref, minilm.embed(student, tok, held))
        print(f"{name:22s} {c['mean_cosine']:12.4f} {c['min_cosine']:8.4f} {c['top1_agreement']:6.3f} "
              f"{(time.perf_counter() - t) / 60:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="resnet18,minilm")
    ap.add_argument("--no-openvino", dest="openvino", action="store_false")
    ap.add_argument("--quality", type=int, metavar="STEPS", help="train and compare quality instead (see above)")
    ap.add_argument("--configs", default="", help=f"with --quality: some of {','.join(QUALITY)} (default all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.openvino:
        try:
            import openvino  # noqa: F401
        except ImportError:
            args.openvino = False
    with tempfile.TemporaryDirectory(prefix="int4-deploy-") as folder:
        if args.quality is not None:
            quality(folder, args.quality, [c for c in args.configs.split(",") if c])
            return
        if "resnet18" in args.models:
            resnet(folder, args)
        if "minilm" in args.models:
            minilm_rows(folder, args)


if __name__ == "__main__":
    main()
