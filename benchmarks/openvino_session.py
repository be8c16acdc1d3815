"""OpenVINO's CPU plugin behind the two calls ``openamct.export.ort_session.latency_ms`` makes of
an ONNX Runtime session (``get_inputs()[i].name``, ``run(None, feeds)``), so a benchmark times
ORT and OpenVINO in the same interleaved rounds (users on Intel CPUs pick OpenVINO).

Compiled as the tests compile it (tests/runtimes.py: f32 inference precision).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.runtimes import openvino_compile


@dataclass
class _Input:
    name: str


class OpenVINOSession:
    def __init__(self, path: str, threads: int = 2) -> None:
        self.compiled = openvino_compile(path, threads, PERFORMANCE_HINT="LATENCY")
        self.request = self.compiled.create_infer_request()
        self._inputs = [_Input(sorted(i.get_names())[0]) for i in self.compiled.inputs]

    def get_inputs(self) -> list[_Input]:
        return self._inputs

    def run(self, _outputs, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = self.request.infer(feeds)
        return [out[o] for o in self.compiled.outputs]
