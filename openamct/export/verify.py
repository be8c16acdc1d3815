"""``openamct verify``: run the fake-quant and the deploy ONNX models on the same random batch in
ONNX Runtime (CPU, 2 intra-op threads) and report how well they agree and how fast each runs."""

from __future__ import annotations

import logging
import os

import numpy as np

from openamct.export.int8_kernels import saturation_note, warn_if_u8s8_saturates
from openamct.export.ort_session import THREADS, latency_ms, session

logger = logging.getLogger(__name__)

__all__ = ["verify_pair", "format_verification"]

_NP_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
             "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def _feeds(sess, input_shape: tuple[int, ...], batch: int | None, seed: int) -> dict[str, np.ndarray]:
    """The first input gets ``input_shape``; other inputs their declared shapes, symbolic dims
    taken from ``input_shape`` at the same position (else 1). Floats ~ N(0, 1), integers 1
    (valid token ids / attention masks), booleans True."""
    rng = np.random.default_rng(seed)
    shape0 = list(input_shape)
    if batch is not None:
        shape0[0] = batch
    feeds = {}
    for k, inp in enumerate(sess.get_inputs()):
        if k == 0:
            shape = shape0
        else:
            shape = [d if isinstance(d, int) and d > 0 else (shape0[i] if i < len(shape0) else 1)
                     for i, d in enumerate(inp.shape)]
        dtype = _NP_TYPES.get(inp.type)
        if dtype is None:
            raise ValueError(f"input {inp.name!r} has type {inp.type}, which verify cannot generate")
        if np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[inp.name] = np.ones(shape, dtype=dtype)
    return feeds


def _check_same_save(fake_path: str, fake, deploy_path: str, deploy) -> None:
    """The two files of one save carry one save id (files older than the id carry none)."""
    from openamct.export.writer import SAVE_ID_KEY

    a = fake.get_modelmeta().custom_metadata_map.get(SAVE_ID_KEY)
    b = deploy.get_modelmeta().custom_metadata_map.get(SAVE_ID_KEY)
    if a != b:
        raise ValueError(f"{fake_path!r} and {deploy_path!r} are not from the same save (save id {a or 'none'} vs "
                         f"{b or 'none'}): an interrupted or partial save_*? save the model again")


def _agreement(a: np.ndarray, b: np.ndarray) -> dict:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    denom = np.linalg.norm(a64) * np.linalg.norm(b64)
    cos = float(a64 @ b64 / denom) if denom > 0 else float(np.array_equal(a64, b64))
    out = {"max_abs_diff": float(np.max(np.abs(a64 - b64))) if a64.size else 0.0, "cosine": cos,
           "argmax_agreement": None}
    if a.ndim >= 2 and a.shape[-1] > 1:
        rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        out["argmax_agreement"] = float(np.mean(rows_a.argmax(1) == rows_b.argmax(1)))
    return out


def verify_pair(fake_path: str, deploy_path: str, input_shape, batch: int | None = None,
                runs: int = 20, seed: int = 0) -> dict:
    """Compare ``fake_path`` and ``deploy_path`` on one random batch; returns a dict with
    ``outputs`` (per output: max_abs_diff, cosine, argmax_agreement), the first output's
    numbers at top level, ``fake_ms`` / ``deploy_ms`` (median latency) and ``speedup``."""
    for name, path in (("fake_path", fake_path), ("deploy_path", deploy_path)):
        if not isinstance(path, str) or not os.path.isfile(path):
            raise ValueError(f"{name}: {path!r} is not a file")
    shape = tuple(input_shape) if isinstance(input_shape, (tuple, list)) else None
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
        raise ValueError(f"input_shape: expected positive ints like (1, 3, 224, 224), got {input_shape!r}")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0):
        raise ValueError(f"batch: expected a positive int, got {batch!r}")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs: expected an int >= 1, got {runs!r}")
    fake, deploy = session(fake_path), session(deploy_path)
    _check_same_save(fake_path, fake, deploy_path, deploy)
    names = [i.name for i in fake.get_inputs()]
    if names != [i.name for i in deploy.get_inputs()]:
        raise ValueError(f"the two models take different inputs: {names} vs "
                         f"{[i.name for i in deploy.get_inputs()]}")
    feeds = _feeds(fake, shape, batch, seed)
    try:
        ya, yb = fake.run(None, feeds), deploy.run(None, feeds)
    except Exception as exc:
        raise ValueError(f"running the models on inputs {({k: list(v.shape) for k, v in feeds.items()})} "
                         f"failed (wrong --input-shape?): {exc}") from exc
    outputs = []
    for meta, a, b in zip(fake.get_outputs(), ya, yb, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"output {meta.name!r}: shapes differ, {list(a.shape)} vs {list(b.shape)}")
        outputs.append({"name": meta.name, "shape": list(a.shape), **_agreement(a, b)})
    # No warm-up: the agreement run above was each session's first run.
    lat = latency_ms({"fake": fake, "deploy": deploy}, feeds, runs=runs, warmup=0)
    fake_ms, deploy_ms = lat["fake"], lat["deploy"]
    result = {"inputs": {k: list(v.shape) for k, v in feeds.items()}, "outputs": outputs,
              "fake_ms": fake_ms, "deploy_ms": deploy_ms,
              "speedup": fake_ms / deploy_ms if deploy_ms > 0 else float("inf"), "runs": runs,
              "u8s8_saturates": warn_if_u8s8_saturates()}
    result.update({k: outputs[0][k] for k in ("max_abs_diff", "cosine", "argmax_agreement")})
    return result


def format_verification(result: dict) -> str:
    lines = ["inputs: " + ", ".join(f"{k} {v}" for k, v in result["inputs"].items())]
    for o in result["outputs"]:
        arg = "n/a" if o["argmax_agreement"] is None else f"{100 * o['argmax_agreement']:.2f}%"
        lines.append(f"output {o['name']} {o['shape']}: max abs diff {o['max_abs_diff']:.6g}, "
                     f"cosine {o['cosine']:.6f}, argmax agreement {arg}")
    lines.append(f"latency (median of {result['runs']}, ONNX Runtime CPU, {THREADS} threads): "
                 f"fake-quant {result['fake_ms']:.2f} ms, deploy {result['deploy_ms']:.2f} ms, "
                 f"deploy is {result['speedup']:.2f}x faster")
    if result.get("u8s8_saturates"):
        lines.append(saturation_note("the agreement above is lower than on CPUs with VNNI or AMX"))
    return "\n".join(lines)
