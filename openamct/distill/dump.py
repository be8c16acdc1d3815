"""The teacher's outputs on disk (``data_dump: true``): the first epoch runs the teacher and
writes, per batch, the model input and each group's input and output; later epochs read them
back instead of running the teacher again. One batch in memory at a time; each file is written
to a temporary name and renamed, so a killed run never leaves a half-written batch. Plain
``.npz`` files read with ``allow_pickle=False``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import Tensor

from openamct._atomic import atomic_path

__all__ = ["TeacherDump"]


def _flat(x: Any) -> dict[str, np.ndarray]:
    """The model input as named arrays: ``t`` (a tensor), ``s<i>`` (a sequence), ``d:<key>`` (a dict)."""
    if isinstance(x, Tensor):
        return {"t": x.detach().cpu().numpy()}
    if isinstance(x, dict):
        return {f"d:{k}": v.detach().cpu().numpy() for k, v in x.items()}
    return {f"s{i}": v.detach().cpu().numpy() for i, v in enumerate(x)}


def _unflat(arrays: dict[str, np.ndarray]) -> Any:
    if "t" in arrays:
        return torch.from_numpy(arrays["t"])
    keys = [k for k in arrays if k.startswith("d:")]
    if keys:
        return {k[2:]: torch.from_numpy(arrays[k]) for k in keys}
    seq = sorted((k for k in arrays if k.startswith("s")), key=lambda k: int(k[1:]))
    return tuple(torch.from_numpy(arrays[k]) for k in seq)


class TeacherDump:
    """Batches ``0..n-1`` of one distillation run in ``folder`` (which the caller owns)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.count = 0

    def _path(self, i: int) -> str:
        return os.path.join(self.folder, f"batch_{i:06d}.npz")

    def write(self, x: Any, inputs: dict[int, Tensor], outputs: dict[int, Tensor]) -> None:
        arrays = {f"x.{k}": v for k, v in _flat(x).items()}
        arrays.update({f"in.{g}": t.detach().cpu().numpy() for g, t in inputs.items()})
        arrays.update({f"out.{g}": t.detach().cpu().numpy() for g, t in outputs.items()})
        with atomic_path(self._path(self.count), ".npz") as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
        self.count += 1

    def read(self, i: int) -> tuple[Any, dict[int, Tensor], dict[int, Tensor]]:
        with np.load(self._path(i), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        x = _unflat({k[2:]: v for k, v in arrays.items() if k.startswith("x.")})
        ins = {int(k[3:]): torch.from_numpy(v) for k, v in arrays.items() if k.startswith("in.")}
        outs = {int(k[4:]): torch.from_numpy(v) for k, v in arrays.items() if k.startswith("out.")}
        return x, ins, outs
