"""One ONNX Runtime CPU session and one latency measurement, shared by ``openamct verify`` and
the demo, so both time models the same way.

Latency: the models are timed in interleaved rounds (order alternating) and the median taken,
so a burst of load from other processes hits every model alike instead of whichever happened
to run then.
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["THREADS", "latency_ms", "session"]

THREADS = 2


def session(path: str, threads: int = THREADS):
    """A CPU ``InferenceSession`` with ``threads`` intra-op threads; a file ONNX Runtime cannot
    load raises ``ValueError`` naming it."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # Spinning worker threads buy an idle machine a few percent, but on a shared one they burn
    # the cores other processes need and made medians swing 3x between runs (measured here).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
        raise ValueError(f"{path}: ONNX Runtime cannot load it: {exc}") from exc


def latency_ms(sessions: dict, feeds: np.ndarray | dict[str, np.ndarray], runs: int = 100,
               warmup: int = 5, min_s: float = 0.0, by_position: bool = False) -> dict[str, float]:
    """Median wall time (ms) of one ``run`` per session, timed in interleaved rounds.

    ``feeds``: an array (each session's first input) or a name -> array dict (every session;
    with ``by_position``, its values go to each session's inputs in order, whatever their names).
    ``min_s``: keep adding rounds (up to 100x ``runs``) until this many seconds were timed; a
    0.1 ms model timed 30 times is 3 ms of samples, and one scheduler hiccup moves its median."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if by_position:
        values = list(feeds.values())
        per_session = {k: {i.name: v for i, v in zip(s.get_inputs(), values, strict=True)}
                       for k, s in sessions.items()}
    else:
        per_session = {k: feeds if isinstance(feeds, dict) else {s.get_inputs()[0].name: feeds}
                       for k, s in sessions.items()}
    for k, s in sessions.items():
        for _ in range(warmup):
            s.run(None, per_session[k])
    times: dict[str, list[float]] = {k: [] for k in sessions}
    keys = list(sessions)
    start, r = time.perf_counter(), 0
    while r < runs or (time.perf_counter() - start < min_s and r < 100 * runs):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            t0 = time.perf_counter()
            sessions[k].run(None, per_session[k])
            times[k].append(time.perf_counter() - t0)
        r += 1
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}
