"""Quantizer modules. All their runtime state lives in parameters/buffers (SPEC house rules).

- ``ActULQ``: activation fake quant (INT8) with learnable clip_max/clip_min (ULQ), initialised from
  the first ``batch_num`` batches it sees (any mode) unless clips were given.
- ``WeightARQ`` / ``WeightULQ``: symmetric weight fake quant (INT8, or INT4 weight-only), per
  output channel or per tensor.

Each takes its number format (``openamct.formats.QuantFormat``) at construction and its integer
range from it; ``format`` says which (the record writes its name, the export maps it).
- ``RangeObserver``: running min/max of a tensor (training mode only) for the deploy export.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
from torch import Tensor, nn

from openamct._checks import all_finite
from openamct.formats import INT8_ACT, INT8_WEIGHT, QuantFormat, check_format
from openamct.quant.act_qparams import ActQParams, QParamTable
from openamct.quant.clip_init import init_clips
from openamct.quant.functions import (
    SCALE_EPS,
    NonFiniteClip,
    arq_scales,
    arq_weight_fake_quant,
    graph_mode,
    ulq_qparams_float,
    ulq_weight_fake_quant,
)
from openamct.quant.host_flags import forget_host_flags, host_flag, set_host_flag
from openamct.quant.range_observer import RangeObserver
from openamct.quant.ulq_act import ulq_act_fake_quant

logger = logging.getLogger(__name__)

__all__ = ["ActULQ", "WeightARQ", "WeightULQ", "RangeObserver", "host_flag", "set_host_flag",
           "forget_host_flags"]


def _check_clip(name: str, value, sign: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or (sign > 0 and v <= 0) or (sign < 0 and v >= 0):
        raise ValueError(f"{name}: must be {'> 0' if sign > 0 else '< 0'}, got {value}")
    return v


def _dist_world() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class ActULQ(nn.Module):
    """ULQ activation quantizer (asymmetric, per tensor; ``fmt``: INT8) (docs/dev/reference.md, Algorithms). One instance may be shared by several layers
    reading the same tensor; a repeated call on the very same tensor object does not count as
    another initialisation batch."""

    def __init__(self, clip_max: float | None = None, clip_min: float | None = None,
                 fixed_min: bool = False, batch_num: int = 1, fmt: QuantFormat = INT8_ACT) -> None:
        super().__init__()
        self.format = check_format(fmt, symmetric=False)
        if (clip_max is None) != (clip_min is None):
            raise ValueError("clip_max/clip_min: give both or neither")
        if not isinstance(fixed_min, bool):
            raise TypeError(f"fixed_min: expected a bool, got {type(fixed_min).__name__}")
        if isinstance(batch_num, bool) or not isinstance(batch_num, int):
            raise TypeError(f"batch_num: expected an int, got {type(batch_num).__name__}")
        if batch_num < 1:
            raise ValueError(f"batch_num: must be >= 1, got {batch_num}")
        given = clip_max is not None
        cmax = _check_clip("clip_max", clip_max, +1) if given else 1.0
        cmin = _check_clip("clip_min", clip_min, -1) if given else 0.0
        self.batch_num = batch_num
        self.clip_max = nn.Parameter(torch.tensor(cmax))
        self.clip_min = nn.Parameter(torch.tensor(cmin))
        self.register_buffer("initialized", torch.tensor(given))
        self.register_buffer("fixed_min", torch.tensor(fixed_min))
        set_host_flag(self, "initialized", given)
        set_host_flag(self, "fixed_min", fixed_min)
        self.register_buffer("init_batches", torch.tensor(0, dtype=torch.long))
        # Extremes over the init batches so far and the sum of the clips each batch chose.
        self.register_buffer("init_range", torch.zeros(2))
        self.register_buffer("init_clip_sum", torch.zeros(2, dtype=torch.float64))
        self._init_last_input: Tensor | None = None  # dedup for shared quantizers, init only
        self._last: tuple | None = None  # (weakref to the input, key, weakref to the output) of the last call
        self.layer_name = ""  # for messages: the (first) layer it quantizes the input of

    @property
    def is_initialized(self) -> bool:
        """``initialized`` without a device read in the steady state (``host_flag``)."""
        return host_flag(self, "initialized")

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        forget_host_flags(self)

    def fixed_flag(self) -> bool:
        """``fixed_min`` without a device read in the steady state (``host_flag``)."""
        return host_flag(self, "fixed_min")

    def use_table(self, table: QParamTable | None) -> None:
        """Take this quantizer's quantization parameters from ``table`` (the record keeper's,
        refreshed once per forward for all of a model's quantizers) while its row is current."""
        self.__dict__["_qtable"] = table

    def qparams(self) -> ActQParams:
        """The current clips' quantization parameters (``act_qparams``): the shared table's row
        when it is current, else this quantizer's own one-row table, recomputed when stale."""
        shared = self.__dict__.get("_qtable")
        if shared is not None:
            row = shared.row(self)
            if row is not None:
                return row
        own = self.__dict__.get("_own_table")
        if own is None:
            own = self.__dict__["_own_table"] = QParamTable([self], self.format)
        return own.own_row(self)

    def forward(self, x: Tensor) -> Tensor:
        exporting = graph_mode()
        if not exporting and not self.is_initialized:
            self._init_step(x)
        fixed = self.fixed_min if exporting else host_flag(self, "fixed_min")
        # An inference tensor has no version to prove it unchanged; a compiled forward keeps no
        # host-side cache (the compiler removes the repeated computation itself).
        if exporting or torch.compiler.is_compiling():
            return ulq_act_fake_quant(x, self.clip_max, self.clip_min, fixed, self.format)
        if x.is_inference():
            return ulq_act_fake_quant(x, self.clip_max, self.clip_min, fixed, self.format, self.qparams())
        # A shared quantizer (q/k/v, gate/up) is called by each layer on the same tensor: the
        # first call's output serves the others, so the fake quant and its backward run once
        # per tensor, not once per reader (each costs a dozen ops on the activation).
        # Weak references: the output lives as long as its readers keep it, no longer.
        key = (x._version, self.clip_max._version, self.clip_min._version, self.fixed_min._version,
               torch.is_grad_enabled())
        last = self._last
        if last is not None and last[0]() is x and last[1] == key:
            y = last[2]()
            if y is not None:
                return y
        y = ulq_act_fake_quant(x, self.clip_max, self.clip_min, fixed, self.format, self.qparams())
        self._last = (weakref.ref(x), key, weakref.ref(y))
        return y

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_last"] = None  # weak references do not pickle
        state.pop("_qtable", None)  # tables hold device tensors of one model: a copy makes its own
        state.pop("_own_table", None)
        return state

    @torch.no_grad()
    def _init_step(self, x: Tensor) -> None:
        if self._init_last_input is x:
            return
        if not all_finite(x):  # one sum, no bool copy of the batch
            raise ValueError(f"layer {self.layer_name or '?'!r}: its input batch holds NaN/inf values, so its "
                             "activation clips cannot be initialised from it: check the data (and the layers "
                             "before this one)")
        self._init_last_input = x
        fixed = host_flag(self, "fixed_min")
        n = int(self.init_batches)
        running = (float(self.init_range[0]), float(self.init_range[1])) if n else None
        (cmax, cmin), (hi, lo) = init_clips(x, fixed, running, self.format)
        world = _dist_world()
        if world > 1:
            # Every rank must end with the same clips: average the searched clips, merge ranges.
            dist = torch.distributed
            dev = x.device if dist.get_backend() != "gloo" else torch.device("cpu")
            clips = torch.tensor([cmax, cmin], dtype=torch.float64, device=dev)
            dist.all_reduce(clips)
            cmax, cmin = (clips / world).tolist()
            rng = torch.tensor([hi, -lo], dtype=torch.float64, device=dev)
            dist.all_reduce(rng, op=dist.ReduceOp.MAX)
            hi, lo = rng[0].item(), -rng[1].item()
        self.init_range.copy_(torch.tensor([hi, lo], device=self.init_range.device))
        self.init_clip_sum += torch.tensor([cmax, cmin], dtype=torch.float64,
                                           device=self.init_clip_sum.device)
        n += 1
        self.init_batches.fill_(n)
        mean = (self.init_clip_sum / n).tolist()
        self.clip_max.fill_(mean[0])
        self.clip_min.fill_(0.0 if fixed else mean[1])
        if n >= self.batch_num:
            self.initialized.fill_(True)
            set_host_flag(self, "initialized", True)
            self._init_last_input = None
            logger.debug("ActULQ initialised after %d batch(es): clip_max=%.6g clip_min=%.6g",
                         n, mean[0], mean[1])

    def scale_offset(self) -> tuple[float, int]:
        """(scale, offset) of the current clips in ``format``, exactly as the forward uses them."""
        try:
            s, zp, _, _ = ulq_qparams_float(self.clip_max.item(), self.clip_min.item(),
                                            bool(self.fixed_min), self.format)
        except NonFiniteClip as exc:
            raise NonFiniteClip(f"{self.layer_name or 'activation quantizer'}: {exc}") from None
        return s, zp

    def extra_repr(self) -> str:
        return (f"{self.format.name}, clip_max={self.clip_max.item():.6g}, clip_min={self.clip_min.item():.6g}, "
                f"fixed_min={bool(self.fixed_min)}, batch_num={self.batch_num}, "
                f"initialized={bool(self.initialized)}")


class _WeightQuant(nn.Module):
    def __init__(self, channel_wise: bool, axis: int, groups: int, fmt: QuantFormat) -> None:
        super().__init__()
        if not isinstance(channel_wise, bool):
            raise TypeError(f"channel_wise: expected a bool, got {type(channel_wise).__name__}")
        self.channel_wise = channel_wise
        # The granularity is the quantizer's own (``channel_wise``): the format says the rest.
        self.format = check_format(fmt, symmetric=True).granular(channel_wise)
        self.bind(axis, groups)

    def bind(self, axis: int, groups: int = 1) -> None:
        """Set the output-channel layout of the weights this quantizer sees (``CompressedLayer``
        calls it): axis 0 for Conv/Linear; axis 1 and the conv's groups for ConvTranspose."""
        if axis not in (0, 1):
            raise ValueError(f"axis: must be 0 or 1, got {axis}")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups: must be an int >= 1, got {groups!r}")
        self.axis, self.groups = axis, groups

    @property
    def commutes_with_channel_scale(self) -> bool:
        """q(w * c) == c * q(w) for any per-output-channel c: lets BN folding skip the multiply."""
        return False

    @property
    def scales_from_weight(self) -> bool:
        """The scales are max|w|/qmax of the weight alone (nothing learned, nothing clipped):
        a writer may compute the effective weight itself (``large.fused_linear``)."""
        return False

    def extra_repr(self) -> str:
        return f"{self.format.name}, channel_wise={self.channel_wise}, axis={self.axis}, groups={self.groups}"


class WeightARQ(_WeightQuant):
    """ARQ: s = max|w|/qmax per output channel (or tensor), recomputed every call; STE backward."""

    def __init__(self, channel_wise: bool = True, axis: int = 0, groups: int = 1,
                 fmt: QuantFormat = INT8_WEIGHT) -> None:
        super().__init__(channel_wise, axis, groups, fmt)
        self.last_scales: Tensor | None = None

    @property
    def commutes_with_channel_scale(self) -> bool:
        # Symmetric, per-channel, nothing clipped and round() is odd: q(c w) = c q(w) exactly
        # in real arithmetic, so the folded BN scale can stay out of the training path.
        return self.channel_wise

    @property
    def scales_from_weight(self) -> bool:
        return True

    def forward(self, w: Tensor) -> Tensor:
        # Kept for the record (CompressedLayer.weight_scales), which then need not recompute
        # them; none while tracing, where the scales are part of the graph.
        fmt = self.format
        self.last_scales = None if graph_mode() else arq_scales(w, self.channel_wise, self.axis, self.groups, fmt)
        return arq_weight_fake_quant(w, self.channel_wise, self.axis, self.groups, self.last_scales, fmt)

    def scales(self, w: Tensor) -> Tensor:
        return arq_scales(w, self.channel_wise, self.axis, self.groups, self.format)


class WeightULQ(_WeightQuant):
    """ULQ weights: a learnable per-channel (or per-tensor) scale initialised by ARQ from the
    first weight it sees (``CompressedLayer.wrap`` does that at wrap time so the parameter has
    its final shape before any optimizer or ``load_state_dict`` sees it)."""

    def __init__(self, channel_wise: bool = True, axis: int = 0, groups: int = 1,
                 fmt: QuantFormat = INT8_WEIGHT) -> None:
        super().__init__(channel_wise, axis, groups, fmt)
        self.scale = nn.Parameter(torch.ones(1))
        self.register_buffer("initialized", torch.tensor(False))
        set_host_flag(self, "initialized", False)

    @torch.no_grad()
    def init_from(self, w: Tensor) -> None:
        s = arq_scales(w, self.channel_wise, self.axis, self.groups, self.format).to(self.scale.dtype)
        if self.scale.shape != s.shape:
            self.scale.data = s.clone()
        else:
            self.scale.copy_(s)
        self.initialized.fill_(True)
        set_host_flag(self, "initialized", True)

    @property
    def is_initialized(self) -> bool:
        """``initialized`` without a device read in the steady state (``host_flag``)."""
        return host_flag(self, "initialized")

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        forget_host_flags(self)

    def forward(self, w: Tensor) -> Tensor:
        if not graph_mode() and not self.is_initialized:
            self.init_from(w)
        return ulq_weight_fake_quant(w, self.scale, self.axis, self.groups, self.channel_wise, self.format)

    def scales(self, w: Tensor | None = None) -> Tensor:
        return self.scale.detach().float().clamp(min=SCALE_EPS).clone()
