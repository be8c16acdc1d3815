"""``openamct verify``: is the deploy model faster than FP32, and does it compute the same?

The files (a deploy model, and the fake-quant model of the same save and/or an FP32 export)
are told apart by their content (``onnx_kinds``), run in ONNX Runtime (CPU, 2 intra-op
threads) on the same random inputs, and timed in interleaved rounds. Agreement is measured
over several inputs (``agreement.compare_outputs``), so it means something at batch 1 too.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from openamct.export.agreement import compare_outputs
from openamct.export.int8_kernels import saturation_note, warn_if_u8s8_saturates
from openamct.export.onnx_kinds import file_info, ort_kernels, split_kernels
from openamct.export.ort_session import THREADS, latency_ms, session

logger = logging.getLogger(__name__)

__all__ = ["verify_files", "verify_pair", "format_verification", "summary_line"]

_NP_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
             "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}
ROLES = ("deploy", "fake-quant", "fp32")


def _feeds(sess, shape0: list[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The first input gets ``shape0``; other inputs their declared shapes, symbolic dims
    taken from ``shape0`` at the same position (else 1). Floats ~ N(0, 1), integers 1
    (valid token ids / attention masks), booleans True."""
    feeds = {}
    for k, inp in enumerate(sess.get_inputs()):
        shape = shape0 if k == 0 else [d if isinstance(d, int) and d > 0 else (shape0[i] if i < len(shape0) else 1)
                                       for i, d in enumerate(inp.shape)]
        dtype = _NP_TYPES.get(inp.type)
        if dtype is None:
            raise ValueError(f"input {inp.name!r} has type {inp.type}, which verify cannot generate")
        feeds[inp.name] = (rng.standard_normal(shape).astype(dtype) if np.issubdtype(dtype, np.floating)
                           else np.ones(shape, dtype=dtype))
    return feeds


def _roles(paths, fp32_path) -> tuple[dict[str, str], list[str]]:
    """role -> path, and notes for the report."""
    infos = [file_info(p) for p in paths]
    forced = file_info(fp32_path) if fp32_path is not None else None
    roles: dict[str, list] = {r: [] for r in ROLES}
    for info in infos:
        roles[info.kind].append(info)
    notes = []
    if forced is not None:
        if forced.integer_weights:
            raise ValueError(f"fp32: {fp32_path!r} holds integer weights ({forced.integer_weights} tensors): it is a "
                             "deploy model, not an FP32 export")
        roles["fp32"].append(forced)
    if not roles["deploy"]:
        pair = roles["fake-quant"]
        if not pair:
            raise ValueError("no deploy model among the files: none holds integer weights or comes from save_* "
                             f"({', '.join(repr(p) for p in paths)})")
        # a prune-only save writes one float model twice: its deploy file is the deploy model
        named = [i for i in pair if i.path.endswith("deploy_model.onnx")] or pair[-1:]
        roles["deploy"] = named[:1]
        roles["fake-quant"] = [i for i in pair if i is not named[0]]
        notes.append("no file holds integer weights: a prune-only save, whose two files are the same float model")
    for role, found in roles.items():
        if len(found) > 1:
            what = "hold integer weights" if role == "deploy" else f"look like {role} files"
            raise ValueError(f"{' and '.join(repr(i.path) for i in found)} all {what}: give one of each kind")
    chosen = {r: found[0] for r, found in roles.items() if found}
    dep, fake, fp32 = chosen["deploy"], chosen.get("fake-quant"), chosen.get("fp32")
    if fake is not None and fake.save_id != dep.save_id:
        raise ValueError(f"{fake.path!r} and {dep.path!r} are not from the same save (save id {fake.save_id or 'none'} "
                         f"vs {dep.save_id or 'none'}): an interrupted or partial save_*? save the model again")
    if fp32 is not None and fp32.fp32_of is not None and fp32.fp32_of != dep.save_id:
        notes.append(f"{fp32.path} was written by another save than {dep.path}")
    return {r: i.path for r, i in chosen.items()}, notes


def _check_args(input_shape, feeds, batch, runs, samples) -> list[int] | None:
    if feeds is None:
        shape = tuple(input_shape) if isinstance(input_shape, (tuple, list)) else None
        if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
            raise ValueError(f"input_shape: expected positive ints like (1, 3, 224, 224), got {input_shape!r}")
    elif not isinstance(feeds, dict):
        raise TypeError(f"feeds: expected a dict of input name -> array, got {type(feeds).__name__}")
    for name, value, low in (("batch", batch, 1), ("runs", runs, 1), ("samples", samples, 1)):
        if value is None and name == "batch":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if feeds is not None:
        return None
    shape0 = list(input_shape)
    if batch is not None:
        shape0[0] = batch
    return shape0


def _run(sess, feeds: dict[str, np.ndarray], names: list[str], what: str) -> list[np.ndarray]:
    """Run with the deploy model's input names, matched to ``sess``'s by position."""
    own = [i.name for i in sess.get_inputs()]
    try:
        return sess.run(None, {o: feeds[n] for o, n in zip(own, names, strict=True)})
    except Exception as exc:  # ORT's own exception types
        raise ValueError(f"running the {what} model on inputs {({k: list(v.shape) for k, v in feeds.items()})} "
                         f"failed (wrong --input-shape?): {exc}") from exc


def verify_files(paths, input_shape=None, *, fp32_path: str | None = None, feeds: dict | None = None,
                 batch: int | None = None, runs: int = 20, samples: int = 16, seed: int = 0) -> dict:
    """Compare a deploy model with the fake-quant model of its save and/or an FP32 export.

    ``paths``: one to three ONNX files in any order, each recognised by its content
    (``fp32_path`` is taken as the FP32 export whatever it holds). Inputs: ``samples`` random
    ones of ``input_shape`` (``batch`` overrides its first dim), or ``feeds`` (name -> array)
    first and random ones of its shapes after. Returns the files by role, the agreement of each
    other model with the deploy model per output, each model's median latency over ``runs``
    interleaved runs on the first input, the speed-up over FP32 and ORT's kernels for the deploy
    model."""
    if isinstance(paths, str) or not isinstance(paths, (list, tuple)) or not 1 <= len(paths) <= 3:
        raise ValueError(f"paths: expected a list of one to three ONNX files, got {paths!r}")
    for k, path in enumerate([*paths, *([fp32_path] if fp32_path is not None else [])]):
        if not isinstance(path, str) or not os.path.isfile(path):
            raise ValueError(f"{'paths[%d]' % k if k < len(paths) else 'fp32_path'}: {path!r} is not a file")
    shape0 = _check_args(input_shape, feeds, batch, runs, samples)
    files, notes = _roles(paths, fp32_path)
    sessions = {role: session(path) for role, path in files.items()}
    deploy = sessions["deploy"]
    names = [i.name for i in deploy.get_inputs()]
    for role, sess in sessions.items():
        own = [i.name for i in sess.get_inputs()]
        if len(own) != len(names):
            raise ValueError(f"the {role} model takes {len(own)} inputs {own}, the deploy model {len(names)} {names}")
        if own != names:
            notes.append(f"inputs of the {role} model matched by position: {', '.join(own)}")
    rng = np.random.default_rng(seed)
    first = feeds if feeds is not None else _feeds(deploy, shape0, rng)
    if feeds is not None:
        missing = [n for n in names if n not in feeds]
        if missing:
            raise ValueError(f"feeds: no value for the deploy model's inputs {missing}")
        shape0 = list(np.shape(feeds[names[0]]))
    inputs = [first] + [_feeds(deploy, shape0, rng) for _ in range(samples - 1)]
    outs = {role: [_run(sess, x, names, role) for x in inputs] for role, sess in sessions.items()}
    out_meta = deploy.get_outputs()
    agreement = {}
    for role in ("fake-quant", "fp32"):
        if role in outs:
            agreement[role] = {meta.name: compare_outputs([o[k] for o in outs[role]], [o[k] for o in outs["deploy"]])
                               for k, meta in enumerate(out_meta)}
    # No warm-up: every session has run the samples above.
    lat = latency_ms(sessions, {n: first[n] for n in names}, runs=runs, warmup=0, by_position=True)
    kernels = ort_kernels(files["deploy"])
    integer, floating = split_kernels(kernels) if kernels is not None else (None, None)
    return {"files": files, "notes": notes, "inputs": {k: list(v.shape) for k, v in first.items()},
            "samples": samples, "outputs": [{"name": m.name, "shape": list(o.shape)}
                                            for m, o in zip(out_meta, outs["deploy"][0], strict=True)],
            "agreement": agreement, "latency_ms": lat, "runs": runs, "threads": THREADS,
            "speedup_vs_fp32": lat["fp32"] / lat["deploy"] if "fp32" in lat and lat["deploy"] > 0 else None,
            "integer_kernels": integer, "float_compute_ops": floating, "u8s8_saturates": warn_if_u8s8_saturates()}


def verify_pair(fake_path: str, deploy_path: str, input_shape, batch: int | None = None,
                runs: int = 20, seed: int = 0, samples: int = 16) -> dict:
    """``verify_files`` on the two files of one save, named by role: a ``fake_path`` that holds
    the integer weights (the two given the wrong way round) is a ValueError saying so."""
    for name, path in (("fake_path", fake_path), ("deploy_path", deploy_path)):
        if not isinstance(path, str) or not os.path.isfile(path):
            raise ValueError(f"{name}: {path!r} is not a file")
    a, b = file_info(fake_path), file_info(deploy_path)
    if a.integer_weights and not b.integer_weights:
        raise ValueError(f"fake_path {fake_path!r} holds integer weights ({a.integer_weights} tensors) and deploy_path "
                         f"{deploy_path!r} none: the two are given the wrong way round")
    return verify_files([fake_path, deploy_path], input_shape, batch=batch, runs=runs, samples=samples, seed=seed)


def _label(role: str) -> str:
    return {"fp32": "FP32", "fake-quant": "fake-quant", "deploy": "deploy"}[role]


def _agreement_text(a: dict) -> str:
    text = (f"cosine min {a['cosine_min']:.6f}, mean {a['cosine_mean']:.6f}; max |diff| "
            f"{100 * a['rel_diff']:.2g} % of the output range")
    if a["rows"] is not None:
        text += f"; same top-1 on {a['same_top1']} of {a['rows']} rows"
        if a["near_ties"]:
            text += (f" ({a['near_ties']} of the {a['rows'] - a['same_top1']} others near-ties: top-2 margin under "
                     "twice the usual difference)")
    return text


def _ops(counts: dict[str, int] | None) -> str:
    if counts is None:
        return "not known"
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


def format_verification(result: dict) -> str:
    files = result["files"]
    lines = [f"{_label(r) + ':':11s} {files[r]}" for r in ROLES if r in files]
    lines += [f"note: {n}" for n in result["notes"]]
    lines.append("inputs: " + ", ".join(f"{k} {v}" for k, v in result["inputs"].items())
                 + f"; agreement over {result['samples']} input(s), random N(0, 1) (integer inputs 1)")
    for role, per_output in result["agreement"].items():
        for name, a in per_output.items():
            lines.append(f"deploy vs {_label(role)}, output {name!r}: {_agreement_text(a)}")
    lat = result["latency_ms"]
    lines.append(f"latency (median of {result['runs']} interleaved runs, ONNX Runtime CPU, {result['threads']} threads): "
                 + ", ".join(f"{_label(r)} {lat[r]:.3g} ms" for r in ("fp32", "fake-quant", "deploy") if r in lat))
    if result["speedup_vs_fp32"] is not None:
        lines.append(f"deploy is {result['speedup_vs_fp32']:.2f}x as fast as FP32")
    else:
        lines.append("speed-up over FP32: not measured; give the FP32 model (--fp32 FILE, or --fp32-model "
                     "package.module:factory). The fake-quant model is no FP32 baseline: its quantizers add float ops")
    lines.append(f"ORT kernels of the deploy model: integer {_ops(result['integer_kernels'])}; "
                 f"float compute ops: {_ops(result['float_compute_ops'])}")
    if result.get("u8s8_saturates"):
        lines.append(saturation_note("the agreement above is lower than on CPUs with VNNI or AMX"))
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    """One line: deploy vs FP32 speed and agreement, and the float compute ops ORT still runs."""
    lat, inputs = result["latency_ms"], ", ".join(f"{k} {v}" for k, v in result["inputs"].items())
    where = f"ONNX Runtime CPU, {result['threads']} threads, {inputs}"
    ref = "fp32" if "fp32" in result["agreement"] else "fake-quant" if "fake-quant" in result["agreement"] else None
    if result["speedup_vs_fp32"] is not None:
        head = (f"deploy vs FP32 ({where}): {result['speedup_vs_fp32']:.2f}x as fast, "
                f"{lat['deploy']:.3g} vs {lat['fp32']:.3g} ms")
    else:
        head = f"deploy ({where}): {lat['deploy']:.3g} ms, no FP32 model to compare with"
    parts = [head]
    if ref is not None:
        a = next(iter(result["agreement"][ref].values()))
        agree = f"cosine to {_label(ref)} {a['cosine_mean']:.6f} (min {a['cosine_min']:.6f})"
        if a["rows"] is not None:
            agree += f", same top-1 {a['same_top1']}/{a['rows']}"
        parts.append(agree)
    parts.append(f"float compute ops left: {_ops(result['float_compute_ops'])}")
    return "; ".join(parts)
