"""The demo CNN (MnistNet on the 5k MNIST digits) distilled without labels (docs/distill.md).

    .venv/bin/python benchmarks/distill_mnist.py --out runs/distill_mnist

1. Train the FP32 model with the demo's recipe (``train_mnist``).
2. ``int8``: create_distill_config + create_distill_model (INT8, layer1.0 float as in the demo
   config), ``distill`` on the training images only (the labels are never read), save, test
   accuracy in PyTorch and of the deploy ONNX in ORT.
3. ``filter50_int8``: create_compressed_retrain_model with 50 % filter pruning + INT8 on the
   convs, then ``distill`` the same way.

Targets: INT8 within 0.3 point of FP32; 50 % filter + INT8 within 1 point.

``load_mnist_5k``'s training rows are sorted by digit, so the images are read through a
shuffling DataLoader (``unlabelled_loader``): read in file order every batch holds one digit, and
a filter-pruned student, whose BatchNorm statistics are re-estimated during ``distill``, ends
with statistics of the last digits only (75 % test accuracy after 5 or 10 epochs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import openamct as amct  # noqa: E402
from openamct.demo.data import load_mnist_5k  # noqa: E402
from openamct.demo.models import MnistNet  # noqa: E402
from openamct.demo.train import evaluate, train_mnist  # noqa: E402

INT8 = "quant_skip_layers: 'layer1.0'\n"
FILTER = """retrain_data_quant_config { ulq_quantize { } }
retrain_weight_quant_config { arq_retrain { channel_wise: true } }
quant_skip_layers: "layer1.0"
""" + "".join(f"""override_layer_configs {{ layer_name: "{n}" prune_config {{ filter_pruner {{
  balanced_l2_norm_filter_prune {{ prune_ratio: 0.5 ascend_optimized: false }} }} }} }}
""" for n in ("layer1.0", "layer2.0", "layer3.0", "layer4.0"))


def unlabelled_loader(x: torch.Tensor, batch_size: int = 64, seed: int = 0,
                      shuffle: bool = True) -> torch.utils.data.DataLoader:
    """The images ``x`` (no labels) in batches of ``batch_size``, reshuffled on every pass (a
    seeded generator: the same run gives the same batches), or in file order (``shuffle``
    false: upstream's call example, ``DataLoader(input_data)``). A batch is ``[images]``, whose
    first element ``distill``'s default sample takes as the model input."""
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=batch_size, shuffle=shuffle,
                                       generator=torch.Generator().manual_seed(seed))


def ort_accuracy(path: str, x: torch.Tensor, y: torch.Tensor) -> float:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    pred = np.concatenate([sess.run(None, {name: x[i:i + 250].numpy()})[0].argmax(1) for i in range(0, len(x), 250)])
    return float((pred == y.numpy()).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/distill_mnist")
    ap.add_argument("--epochs", type=int, default=2, help="distillation epochs over the 4,000 training images")
    ap.add_argument("--lr", type=float, default=1e-4, help="distill lr for INT8")
    ap.add_argument("--lr-filter", type=float, default=1e-3, help="distill lr for 50 %% filter + INT8")
    ap.add_argument("--flows", default="int8,filter50_int8")
    ap.add_argument("--fp32-epochs", type=int, default=15, help="epochs of the FP32 model (the demo's recipe: 15)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--order", choices=("shuffled", "file"), default="shuffled",
                    help="read the training images shuffled, or in file order (sorted by digit)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_mnist_5k()
    t0 = time.perf_counter()
    fp32 = MnistNet()
    cached = os.path.join(args.out, f"fp32_seed{args.seed}_epochs{args.fp32_epochs}.pth")
    if os.path.isfile(cached):  # the FP32 model of an earlier run with the same settings
        fp32.load_state_dict(torch.load(cached, weights_only=True))
    else:
        train_mnist(fp32, x_train, y_train, seed=args.seed, progress=False, epochs=args.fp32_epochs)
        torch.save(fp32.state_dict(), cached)
    fp32.eval()
    metrics = {"fp32": evaluate(fp32, x_test, y_test), "train_fp32_s": time.perf_counter() - t0}
    print(f"FP32 test accuracy {metrics['fp32']:.4f} ({metrics['train_fp32_s']:.0f} s)", flush=True)
    x = x_train[:8]
    js = os.path.join(args.out, "mnist.json")
    cfg = os.path.join(args.out, "mnist_distill.cfg")
    with open(cfg, "w") as f:
        f.write(INT8)
    amct.create_distill_config(js, fp32, x, cfg)
    for name in args.flows.split(","):
        t = time.perf_counter()
        images = unlabelled_loader(x_train, seed=args.seed, shuffle=args.order == "shuffled")  # each flow reads the same batches
        if name == "int8":
            student = amct.create_distill_model(js, fp32, x)
            record = js[:-5] + ".record"
        else:
            fcfg = os.path.join(args.out, "filter50_int8.cfg")
            with open(fcfg, "w") as f:
                f.write(FILTER)
            record = os.path.join(args.out, "filter50_int8.record")
            student = amct.create_compressed_retrain_model(fp32, x, fcfg, record)
        with torch.no_grad():
            student.eval()(next(iter(images))[0])
        before = evaluate(student, x_test, y_test)
        amct.distill(fp32, student, js, images, epochs=args.epochs, lr=args.lr if name == "int8" else args.lr_filter)
        after = evaluate(student, x_test, y_test)
        prefix = os.path.join(args.out, name)
        amct.save_distill_model(student, prefix, x, record_file=record, input_names=["x"], output_names=["logits"],
                                dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}})
        onnx_acc = ort_accuracy(prefix + "_deploy_model.onnx", x_test, y_test)
        metrics[name] = {"before": before, "pytorch": after, "onnx_deploy": onnx_acc,
                         "seconds": time.perf_counter() - t}
        print(f"[{name}] before distill {before:.4f}, after {after:.4f} (PyTorch), deploy ONNX in ORT {onnx_acc:.4f};"
              f" FP32 - ORT = {100 * (metrics['fp32'] - onnx_acc):.2f} points ({metrics[name]['seconds']:.0f} s)",
              flush=True)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)


if __name__ == "__main__":
    main()
