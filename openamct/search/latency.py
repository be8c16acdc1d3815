"""``budget="latency"``: compress_ratio means "times faster in ONNX Runtime on this CPU".

1. A latency table: every conv/linear layer of the prunable part is timed alone in ONNX Runtime
   (a one-node model with the shapes the captured graph saw, batch of one sample) at a few kept
   input/output channel counts taken from the groups' options, which are multiples of 16
   (``ascend_optimized``) or 8 (ORT's x86 kernels block channels by 8/16). Identical layer shapes
   are timed once. Between grid points the table interpolates bilinearly.
2. The whole FP32 model is exported and timed once; the table's sum is scaled to it, so
   ``predicted(kept) = T_fp32 * table(kept) / table(full)`` (the ops between the layers shrink
   with them).
3. The greedy search runs on that prediction. Then the pruned FP32 model itself (the channels
   ``create_prune_retrain_model`` would remove) is exported and timed interleaved with the
   FP32 one; if the measured speed-up misses the request by more than 5 %, the table is
   calibrated on that measurement and the search re-run (at most twice). Of the plans measured,
   the one that best meets the request is kept; the report holds its measured figures.
"""

from __future__ import annotations

import bisect
import copy
import logging
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from openamct.export.ort_session import THREADS, latency_ms, session
from openamct.progress import Progress
from openamct.search.budget import Budget
from openamct.search.space import SearchSpace

logger = logging.getLogger(__name__)

__all__ = ["LatencyTable", "latency_budget", "refine"]

LEVELS = 5  # grid points per axis and layer
TOLERANCE = 0.05


def _levels(options: list[int]) -> list[int]:
    if len(options) <= LEVELS:
        return sorted(options)
    idx = np.linspace(0, len(options) - 1, LEVELS).round().astype(int)
    return sorted({options[i] for i in idx})


def _one_layer(module, x_shape: tuple[int, ...], cin: int, cout: int) -> onnx.ModelProto:
    """A one-node ONNX model of ``module`` with ``cin`` inputs and ``cout`` outputs."""
    rng = np.random.default_rng(0)
    if module.__class__.__name__ == "Linear" or not hasattr(module, "kernel_size"):
        shape = (*x_shape[:-1], cin)
        w = helper.make_tensor("W", TensorProto.FLOAT, (cin, cout), rng.standard_normal(cin * cout).astype(np.float32))
        node = helper.make_node("MatMul", ["x", "W"], ["y"])
    else:
        g = module.groups
        groups = g if g == 1 else max(1, g * cin // module.in_channels)  # depthwise/grouped keep channels per group
        k = tuple(module.kernel_size)
        shape = (x_shape[0], cin, *x_shape[2:])
        wshape = (cout, cin // groups, *k)
        w = helper.make_tensor("W", TensorProto.FLOAT, wshape,
                               rng.standard_normal(int(np.prod(wshape))).astype(np.float32))
        pads = list(module.padding) * 2 if not isinstance(module.padding, str) else None
        attrs = {"strides": list(module.stride), "dilations": list(module.dilation), "group": groups,
                 "kernel_shape": list(k)}
        if pads is not None:
            attrs["pads"] = pads
        node = helper.make_node("Conv", ["x", "W"], ["y"], **attrs)
    graph = helper.make_graph([node], "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), shape


def _time_model(model: onnx.ModelProto, shape, folder: str, runs: int = 15) -> float:
    path = os.path.join(folder, "layer.onnx")
    onnx.save(model, path)
    s = session(path, THREADS)
    return latency_ms({"m": s}, np.random.default_rng(1).standard_normal(shape).astype(np.float32), runs=runs,
                      warmup=3, min_s=0.03)["m"]


@dataclass
class _LayerTable:
    out_group: int | None
    in_group: int | None
    cins: list[int]
    couts: list[int]
    ms: np.ndarray  # [len(cins), len(couts)]
    in_channels: int
    out_channels: int
    repeat: int

    def at(self, kept: list[int], channels: list[int]) -> float:
        cout = self.out_channels if self.out_group is None else \
            kept[self.out_group] * self.out_channels // channels[self.out_group]
        cin = self.in_channels if self.in_group is None else \
            self.in_channels - (channels[self.in_group] - kept[self.in_group]) * self.repeat
        return _bilinear(self.cins, self.couts, self.ms, cin, cout)


def _interp(xs: list[int], x: float) -> tuple[int, int, float]:
    if len(xs) == 1:
        return 0, 0, 0.0
    j = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    return j - 1, j, (x - xs[j - 1]) / (xs[j] - xs[j - 1])


def _bilinear(xs, ys, v, x, y) -> float:
    i0, i1, tx = _interp(xs, x)
    j0, j1, ty = _interp(ys, y)
    top = v[i0, j0] * (1 - ty) + v[i0, j1] * ty
    bot = v[i1, j0] * (1 - ty) + v[i1, j1] * ty
    return float(top * (1 - tx) + bot * tx)


class LatencyTable:
    def __init__(self, work, graph, space: SearchSpace, fp32_ms: float) -> None:
        t0 = time.perf_counter()
        self.space, self.fp32_ms, self.points, self.tables = space, fp32_ms, 0, []
        modules, cache = dict(work.named_modules()), {}
        with tempfile.TemporaryDirectory(prefix="openamct-latency-") as folder, \
                Progress("latency table", total=len(space.layers), logger=logger, unit="layer") as progress:
            def timed(m, x_shape, ci, co):
                key = (type(m).__name__, x_shape, ci, co, str(getattr(m, "kernel_size", "")),
                       str(getattr(m, "stride", "")), str(getattr(m, "padding", "")), getattr(m, "groups", 1))
                if key not in cache:
                    model, shape = _one_layer(m, x_shape, ci, co)
                    cache[key] = _time_model(model, shape, folder)
                    self.points += 1
                return cache[key]

            for c in space.layers:
                m = modules[c.name]
                x_shape = tuple(graph.call_of(c.name).inputs[0].shape)
                depthwise = c.out_group is not None and not c.in_terms and getattr(m, "groups", 1) > 1
                in_group = c.in_terms[0][0] if len(c.in_terms) == 1 else None
                repeat = c.in_terms[0][1] if len(c.in_terms) == 1 else 1
                couts = [c.out_channels] if c.out_group is None else sorted(
                    {k * c.out_channels // space.groups[c.out_group].channels
                     for k in _levels(space.groups[c.out_group].options)})
                if depthwise:  # its inputs follow its outputs: one axis
                    cins = [c.in_channels]
                    ms = np.array([[timed(m, x_shape, co * c.in_channels // c.out_channels, co) for co in couts]])
                else:
                    cins = [c.in_channels] if in_group is None else sorted(
                        {c.in_channels - (space.groups[in_group].channels - k) * repeat
                         for k in _levels(space.groups[in_group].options)})
                    ms = np.array([[timed(m, x_shape, ci, co) for co in couts] for ci in cins])
                self.tables.append(_LayerTable(c.out_group, in_group, cins, couts, ms, c.in_channels,
                                               c.out_channels, repeat))
                progress.update(what=c.name)
        self.full = self.table(space.channels())
        self.seconds = time.perf_counter() - t0
        logger.info("latency table: %d layer shapes timed in %.1f s", self.points, self.seconds)

    def table(self, kept: list[int]) -> float:
        channels = self.space.channels()
        return sum(t.at(kept, channels) for t in self.tables)

    def predict(self, kept: list[int]) -> float:
        return self.fp32_ms * self.table(kept) / self.full


def _pruned_copy(work, space: SearchSpace):
    """The FP32 model with the channels ``create_prune_retrain_model`` would remove, removed."""
    from openamct.sparsity.filter import apply_removal, score_and_select

    model = copy.deepcopy(work)
    groups = []
    for g in space.groups:
        if g.kept < g.channels:
            pg = copy.copy(g.group)
            pg.ratio, pg.ascend_optimized, pg.removed = g.ratio(), g.ascend_optimized, None
            groups.append(pg)
    score_and_select(model, groups)
    apply_removal(model, groups)
    return model.eval()


def _export(model, sample, path: str) -> None:
    from openamct.export.writer import export_onnx, write_onnx

    model.eval()
    write_onnx(export_onnx(model, sample), path)


def _measure(work, sample, space: SearchSpace, folder: str, runs: int = 30) -> tuple[float, float]:
    """(FP32 ms, pruned ms), timed interleaved."""
    fp32, pruned = os.path.join(folder, "fp32.onnx"), os.path.join(folder, "pruned.onnx")
    if not os.path.exists(fp32):
        _export(work, sample, fp32)
    _export(_pruned_copy(work, space), sample, pruned)
    feed = sample.numpy() if hasattr(sample, "numpy") else np.asarray(sample)
    lat = latency_ms({"fp32": session(fp32), "pruned": session(pruned)}, feed, runs=runs, min_s=1.0)
    return lat["fp32"], lat["pruned"]


def latency_budget(work, sample, graph, space: SearchSpace, settings, folder: str) -> Budget:
    """The predicted-latency budget; the ONNX files go to ``folder``, which the caller owns and
    removes (``refine`` reuses the FP32 file written there)."""
    if not hasattr(sample, "numpy"):
        raise ValueError("budget='latency' needs input_data batches whose data is one tensor (the ONNX model's input)")
    fp32 = os.path.join(folder, "fp32.onnx")
    _export(work, sample, fp32)
    fp32_ms = latency_ms({"fp32": session(fp32)}, sample.numpy(), runs=30, min_s=0.5)["fp32"]
    table = LatencyTable(work, graph, space, fp32_ms)
    best = table.predict(space.smallest())
    if fp32_ms / best < settings.compress_ratio:
        raise ValueError(f"config {settings.path!r}: compress_ratio {settings.compress_ratio:g} cannot be met with "
                         f"budget='latency': the smallest allowed sizes are predicted {fp32_ms / best:.3g}x faster "
                         f"({fp32_ms:.2f} -> {best:.2f} ms in ONNX Runtime)")
    return Budget(table.predict, fp32_ms, fp32_ms / settings.compress_ratio, "ms", table=table, folder=folder)


def _calibrated_target(table: LatencyTable, space: SearchSpace, kept: list[int], asked: float,
                       measured: float) -> float:
    """The predicted ms to search for next: the table's error on ``kept`` (predicted/measured
    speed-up, clamped to [2/3, 3/2] so one noisy measurement cannot swing the plan to "prune
    nothing" or "prune everything") applied to the request, within what the space can reach."""
    predicted = table.fp32_ms / table.predict(kept)
    factor = min(max(predicted / measured, 2 / 3), 3 / 2)
    target = table.fp32_ms / (asked * factor)
    return min(max(target, table.predict(space.smallest())), table.predict(space.channels()))


def refine(work, sample, space: SearchSpace, settings, budget: Budget, alg, report) -> None:
    """Measure the pruned model; when it misses the request, calibrate the table on that
    measurement and search again (at most twice). The plan kept is the measured one that best
    meets the request, not merely the last one tried."""
    table, asked = budget.table, settings.compress_ratio
    tried: list[tuple[list[int], float, float]] = []  # (kept, fp32 ms, pruned ms)
    for attempt in range(3):
        kept = space.kept()
        if any(kept == k for k, _, _ in tried) or (attempt and kept == space.channels()):
            break
        fp32_ms, pruned_ms = _measure(work, sample, space, budget.folder)
        tried.append((kept, fp32_ms, pruned_ms))
        measured = fp32_ms / pruned_ms
        if abs(measured / asked - 1) <= TOLERANCE or attempt == 2:
            break
        target = _calibrated_target(table, space, kept, asked, measured)
        logger.info("latency budget: measured %.2fx for %.2fx asked; searching again for a predicted %.2fx",
                    measured, asked, table.fp32_ms / target)
        for g, k in zip(space.groups, alg.search(space, budget.cost, target), strict=True):
            g.kept = k

    def miss(t):  # prefer plans that meet the request, then the closest
        speedup = t[1] / t[2]
        return (speedup < asked * (1 - TOLERANCE), abs(speedup / asked - 1))

    kept, fp32_ms, pruned_ms = min(tried, key=miss)
    for g, k in zip(space.groups, kept, strict=True):
        g.kept = k
    report.latency = {"batch": int(sample.shape[0]), "threads": THREADS, "fp32_ms": fp32_ms, "pruned_ms": pruned_ms,
                      "speedup": fp32_ms / pruned_ms, "predicted_speedup": table.fp32_ms / table.predict(kept),
                      "points": table.points, "table_s": table.seconds, "tried": len(tried)}
