"""The quantization parameters of ULQ activation quantizers, as tensors on the device.

A ULQ quantizer's forward needs its scale, 1/scale and integer bounds, its backward the float
bounds and the coefficients that turn three sums over the tensor into the two clip gradients
(``ulq_act.ULQAct``). All of them follow from the two clips by a chain of small tensor ops
(docs/dev/reference.md, Algorithms): about twenty launches whatever the number of quantizers.
So a ``QParamTable`` computes them for a set of quantizers at once: the record keeper refreshes
one table per number format before every forward of a compressed model, and each quantizer takes
its row (views, no op). A quantizer that is not in a table, or whose clips changed since the
refresh (a calibration forward), computes its own row with the same function. Nothing is read
back to the host, and nothing is copied to the device in a steady step: the table keeps its
constants and fixed-min mask on the device and rebuilds them only when the device or the
quantizers' ``fixed_min`` flags change.

Gradient coefficients. With ``t = clamp(x) / s`` (code units), ``sat = sign(clamp(x) - x)``
(+1 below the range, -1 above, 0 in it) and the three sums
``v = [sum((t - round(t)) * g), sum(sat * g), sum(|sat| * g)]``, upstream's clip gradients are
``[dcmax, dcmin] = coef @ v`` with ``E = [round(cmax/s) - cmax/s, round(cmin/s) - cmin/s]``:
``coef = B + E @ M`` (constants below), affine in E, so three ops give every row. (Outside
the range ``t`` sits on a level, so its first term is zero there up to the rounding of
``y_hi / s``: a few 1e-5 of a code, a relative 1e-7 of that element's own term.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from openamct.formats import QuantFormat
from openamct.quant.functions import SCALE_EPS

__all__ = ["ActQParams", "QParamTable", "compute_rows", "constants", "no_autocast", "row_of"]


def _autocast_on(x: Tensor) -> bool:
    try:
        return torch.is_autocast_enabled(x.device.type)
    except (TypeError, RuntimeError):  # torch < 2.4 has no device argument; meta has no autocast
        return False


def no_autocast(x: Tensor):
    """Autocast off for ``x``'s device while a quantizer computes in float32 (a context)."""
    return torch.autocast(x.device.type, enabled=False) if _autocast_on(x) else contextlib.nullcontext()


@dataclass(frozen=True)
class ActQParams:
    """One quantizer's row: 0-dim float32 tensors (``coef``: [2, 3]) on the clips' device."""

    scale: Tensor
    inv: Tensor  # float32 1/scale, as torch's fake-quant kernels compute inv_scale
    lo: Tensor  # qmin - zero point: the lowest code of round(x / scale)
    hi: Tensor  # qmax - zero point
    y_lo: Tensor  # lo * scale: the lowest representable value
    y_hi: Tensor
    coef: Tensor  # [2, 3]: [dcmax, dcmin] = coef @ [sum(-d * g), sum(sat * g), sum(|sat| * g)]
    fixed: bool  # clip_min pinned at 0: lo == 0 and hi == levels exactly
    fmt: QuantFormat


def constants(fmt: QuantFormat, device: torch.device) -> tuple[Tensor, ...]:
    """The constant tensors of ``compute_rows`` for ``fmt``, made on ``device`` by fills (no
    host-to-device copy): the clips' bounds [2] (low, high), the format's [qmin, qmax], and
    ``coef = B + E @ M``'s B [6] and M [2, 6] (module docstring)."""
    def filled(shape, values: dict) -> Tensor:
        t = torch.zeros(shape, device=device)
        for index, v in values.items():
            t[index].fill_(v)
        return t

    inv_l, half = 1.0 / fmt.levels, 0.5 / fmt.levels
    inf = float("inf")
    return (filled(2, {0: 0.0, 1: -inf}), filled(2, {0: inf, 1: 0.0}),
            filled(2, {0: float(fmt.qmin), 1: float(fmt.qmax)}),
            filled(6, dict(enumerate((-inv_l, -0.5, 0.5, inv_l, 0.5, 0.5)))),
            filled((2, 6), {(0, 1): -half, (0, 2): half, (0, 4): half, (0, 5): -half,
                            (1, 1): half, (1, 2): half, (1, 4): -half, (1, 5): -half}))


def compute_rows(clips: Tensor, fixed: Tensor, fmt: QuantFormat, consts: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """Every quantity of ``ActQParams`` for Q quantizers: ``clips`` [Q, 2] (clip_max, clip_min),
    ``fixed`` [Q, 2] bool (the second column: clip_min pinned at 0), both on one device. The
    arithmetic of ``functions.ulq_qparams`` (which export uses), written once for all rows:
    cmax >= 0 >= cmin, cmin = 0 where fixed, s = max((cmax - cmin) / levels, eps),
    zp = clamp(round(qmin - cmin / s), qmin, qmax). Under twenty ops whatever Q."""
    low, high, qrange, b, m = consts
    with torch.no_grad(), no_autocast(clips):
        c = torch.clamp(clips.detach().float(), min=low, max=high).masked_fill_(fixed, 0.0)
        scale = torch.sub(c[:, 0], c[:, 1]).div_(fmt.levels).clamp_(min=SCALE_EPS)
        r = torch.div(c, scale.unsqueeze(1))  # [cmax / s, cmin / s]
        # coef = b + E @ m without a matrix product, whose rounding depends on Q (the kernel BLAS
        # picks): a quantizer must get the same bits in a table as on its own.
        e = torch.round(r).sub_(r)
        coef = torch.mul(e.unsqueeze(2), m).sum(1).add_(b).view(-1, 2, 3)
        zp = torch.sub(fmt.qmin, r[:, 1]).round_().clamp_(fmt.qmin, fmt.qmax)
        lohi = torch.sub(qrange, zp.unsqueeze(1))  # [qmin - zp, qmax - zp]
        return {"scale": scale, "inv": torch.reciprocal(scale), "lo": lohi[:, 0], "hi": lohi[:, 1],
                "y_lohi": lohi * scale.unsqueeze(1), "coef": coef}


def row_of(rows: dict[str, Tensor], i: int, fixed: bool, fmt: QuantFormat) -> ActQParams:
    """Row ``i`` of ``compute_rows``' result (views)."""
    return ActQParams(rows["scale"][i], rows["inv"][i], rows["lo"][i], rows["hi"][i], rows["y_lohi"][i, 0],
                      rows["y_lohi"][i, 1], rows["coef"][i], fixed, fmt)


class QParamTable:
    """The rows of a set of ULQ quantizers of one format (``ActULQ``), computed together by
    ``refresh``; ``row(q)`` gives ``q``'s row while its clips are the ones the rows came from.

    Not state: nothing here is checkpointed or copied (a deep copy of a model gets quantizers
    with no table, which compute their own rows)."""

    def __init__(self, quantizers, fmt: QuantFormat) -> None:
        self.quantizers = list(quantizers)
        self.fmt = fmt
        self._index = {id(q): i for i, q in enumerate(self.quantizers)}
        self._rows: dict[str, Tensor] | None = None
        self._seen: list[tuple] = []  # per quantizer: the clip tensors, their versions, fixed flag
        self._consts: tuple[torch.device, tuple[Tensor, ...]] | None = None
        self._fixed: tuple[tuple[bool, ...], Tensor] | None = None
        self._views: dict[int, ActQParams] = {}

    @staticmethod
    def _state(q) -> tuple:
        cmax, cmin = q.clip_max, q.clip_min
        return cmax, cmax._version, cmin, cmin._version, q.fixed_flag()

    @staticmethod
    def _same(a: tuple, b: tuple) -> bool:
        return a[0] is b[0] and a[1] == b[1] and a[2] is b[2] and a[3] == b[3] and a[4] == b[4]

    def _device_consts(self, device: torch.device) -> tuple[Tensor, ...]:
        if self._consts is None or self._consts[0] != device:
            self._consts = (device, constants(self.fmt, device))
        return self._consts[1]

    def _fixed_mask(self, flags: tuple[bool, ...], device: torch.device) -> Tensor:
        if self._fixed is None or self._fixed[0] != flags or self._fixed[1].device != device:
            # A copy to the device, made only when the flags or the device change.
            mask = torch.tensor([[False, f] for f in flags], dtype=torch.bool).to(device)
            self._fixed = (flags, mask)
        return self._fixed[1]

    @torch.no_grad()
    def refresh(self) -> None:
        """Recompute every row if any quantizer's clips changed since the last refresh (their
        versions moved: an optimizer step, a load; or the tensors were replaced: ``.to``)."""
        states = [self._state(q) for q in self.quantizers]
        if not states or (self._rows is not None and all(map(self._same, states, self._seen))):
            return
        device = states[0][0].device
        if any(s[0].device != device or s[2].device != device for s in states):
            self._rows, self._seen = None, []  # split across devices: each quantizer on its own
            return
        clips = torch.stack([t for s in states for t in (s[0], s[2])]).view(-1, 2)
        flags = tuple(s[4] for s in states)
        self._rows = compute_rows(clips, self._fixed_mask(flags, device), self.fmt, self._device_consts(device))
        self._seen = states
        self._views = {}

    def row(self, q) -> ActQParams | None:
        """``q``'s row, or None when its clips are not the ones the rows came from."""
        i = self._index.get(id(q))
        if i is None or self._rows is None or not self._same(self._state(q), self._seen[i]):
            return None
        view = self._views.get(i)
        if view is None:
            r = self._rows
            view = self._views[i] = row_of(r, i, self._seen[i][4], self.fmt)
        return view

    def own_row(self, q) -> ActQParams:
        """``row(q)``, refreshed first when stale (for a table of ``q`` alone)."""
        p = self.row(q)
        if p is None:
            self.refresh()
            p = self.row(q)
        return p
