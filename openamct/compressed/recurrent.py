"""``RecurrentLayer``: the compressed form of an ``nn.LSTM`` / ``nn.GRU`` (quantization only).

What is quantized, per (layer, direction) of the recurrent module:
- the layer's input sequence, per tensor (ULQ, like every layer's input in the graph flow);
  the directions of one layer read the same input and share its quantizer;
- the hidden state before each step's recurrent matmul, per tensor (ULQ). Its clips are
  initialised from the whole sequence of hidden states of the first ``batch_num`` forwards,
  which run the recurrence unquantized (a single step's state would give a degenerate range);
- ``weight_ih`` and ``weight_hh``, per row (ARQ or ULQ): each row belongs to one gate of one
  hidden unit, so each gate gets its own scales ("per gate, per channel").
The cell state (LSTM), the gate pre-activations and the outputs stay float.

The recurrence is computed step by step in torch (``run_recurrent``) with torch's gate
equations and gate order (LSTM i, f, g, o; GRU r, z, n with the reset gate applied after the
recurrent matmul), so an unquantized RecurrentLayer computes what the module computed. The
export writers (``openamct.export.recurrent``) reuse ``run_recurrent``.

Parameters keep the wrapped module's names (``weight_ih_l0``, ``bias_hh_l1_reverse``...), so
state-dict keys of the weights do not change; the quantizers add their own keys.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from openamct.compressed.parts import LayerParts
from openamct.layer_types import unsupported_recurrent
from openamct.quant.functions import graph_mode
from openamct.quant.quantizers import ActULQ, WeightULQ

__all__ = ["RecurrentLayer", "RECURRENT_CLASSES", "run_recurrent", "cell_suffixes", "record_keys", "unsupported"]

RECURRENT_CLASSES = {"LSTM": nn.LSTM, "GRU": nn.GRU}
GATES = {"LSTM": 4, "GRU": 3}
HYPER = ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional")


def unsupported(module: nn.Module) -> str | None:
    """Why a recurrent module cannot be quantized, or None."""
    if not isinstance(module, tuple(RECURRENT_CLASSES.values())):
        return f"{type(module).__name__} is not an LSTM or GRU"
    return unsupported_recurrent(module)


def cell_suffixes(num_layers: int, bidirectional: bool) -> list[str]:
    """torch's parameter suffixes, one per (layer, direction): l0, l0_reverse, l1, ..."""
    return [f"l{k}{'_reverse' if d else ''}" for k in range(num_layers) for d in range(1 + int(bidirectional))]


def record_keys(name: str, num_layers: int, bidirectional: bool) -> list[str]:
    """Record keys of a recurrent layer: its name for a single-layer unidirectional module (as
    upstream's records), else ``<name>.<suffix>`` per (layer, direction)."""
    if num_layers == 1 and not bidirectional:
        return [name]
    return [f"{name}.{s}" for s in cell_suffixes(num_layers, bidirectional)]


def lstm_step(gx: Tensor, h: Tensor, c: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> tuple[Tensor, Tensor]:
    i, f, g, o = (gx + F.linear(h, w_hh, b_hh)).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def gru_step(gx: Tensor, h: Tensor, h_float: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
    xr, xz, xn = gx.chunk(3, -1)
    hr, hz, hn = F.linear(h, w_hh, b_hh).chunk(3, -1)
    r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    return (1 - z) * n + z * h_float


def run_recurrent(mod: nn.Module, x: Tensor, hx, weights: Callable[[str], Tensor | None],
                  quant_x: Callable[[int, Tensor], Tensor], quant_h: Callable[[str, Tensor], Tensor],
                  seen_h: Callable[[str, list[Tensor]], None] | None = None):
    """The recurrence of ``mod`` (an LSTM/GRU or a module with its hyper-parameters) on ``x``
    (batched), with the weights ``weights(param_name)`` and the quantizers ``quant_x(layer,
    input)`` and ``quant_h(suffix, hidden)``; ``seen_h(suffix, states)`` receives the states each
    step's recurrent matmul read. Returns what the torch module returns."""
    lstm = mod.mode == "LSTM"
    x = x.transpose(0, 1) if mod.batch_first else x  # time-major from here on
    steps, batch = x.shape[0], x.shape[1]
    dirs = 1 + int(mod.bidirectional)
    n = mod.num_layers * dirs
    if hx is None:
        h0 = x.new_zeros(n, batch, mod.hidden_size)
        c0 = h0 if lstm else None
    else:
        h0, c0 = hx if lstm else (hx, None)
    h_out, c_out = [], []
    for k in range(mod.num_layers):
        xq = quant_x(k, x)
        outs = []
        for d in range(dirs):
            sfx = f"l{k}{'_reverse' if d else ''}"
            idx = k * dirs + d
            gx = F.linear(xq, weights(f"weight_ih_{sfx}"), weights(f"bias_ih_{sfx}"))  # every step at once
            w_hh, b_hh = weights(f"weight_hh_{sfx}"), weights(f"bias_hh_{sfx}")
            h, c = h0[idx], (c0[idx] if lstm else None)
            ys, fed = [None] * steps, []
            for t in (range(steps - 1, -1, -1) if d else range(steps)):
                hq = quant_h(sfx, h)
                fed.append(h)
                if lstm:
                    h, c = lstm_step(gx[t], hq, c, w_hh, b_hh)
                else:
                    h = gru_step(gx[t], hq, h, w_hh, b_hh)
                ys[t] = h
            if seen_h is not None:
                seen_h(sfx, fed)
            outs.append(torch.stack(ys))
            h_out.append(h)
            if lstm:
                c_out.append(c)
        x = outs[0] if dirs == 1 else torch.cat(outs, -1)
        if mod.dropout and mod.training and k < mod.num_layers - 1:
            x = F.dropout(x, mod.dropout, True)
    y = x.transpose(0, 1) if mod.batch_first else x
    hn = torch.stack(h_out)
    return (y, (hn, torch.stack(c_out))) if lstm else (y, hn)


def check_input(mod: nn.Module, x, hx) -> tuple[Tensor, object, bool]:
    """(batched input, batched hx, whether the call was unbatched); refuses what torch's module
    accepts but this layer does not compute (a PackedSequence)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{mod.mode} (quantized): input must be a Tensor, got {type(x).__name__} "
                        "(PackedSequence inputs are not supported: pad the batch instead)")
    if x.dim() not in (2, 3):
        raise ValueError(f"{mod.mode} (quantized): input must be 2-D (unbatched) or 3-D, got shape {tuple(x.shape)}")
    if x.dim() == 3:
        return x, hx, False
    unsq = (lambda t: t.unsqueeze(1)) if hx is not None else None
    if hx is not None:
        hx = tuple(unsq(t) for t in hx) if isinstance(hx, tuple) else unsq(hx)
    return x.unsqueeze(0 if mod.batch_first else 1), hx, True


def squeeze_output(out, lstm: bool, batch_first: bool):
    y, h = out
    y = y.squeeze(0 if batch_first else 1)
    return (y, tuple(t.squeeze(1) for t in h)) if lstm else (y, h.squeeze(1))


class RecurrentLayer(nn.Module):
    """An LSTM or GRU with quantized input, hidden state and weights (module docstring)."""

    _openamct_leaf = True  # graph capture treats it as one op, like the module it wraps

    def __init__(self, module: nn.Module, act_quant: ActULQ, wts_quant: nn.Module) -> None:
        super().__init__()
        self.mode = type(module).__name__ if type(module).__name__ in RECURRENT_CLASSES else module.mode
        self.layer_type = self.mode
        for k in HYPER:
            setattr(self, k, getattr(module, k))
        self.proj_size = 0
        for name, p in module.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.attach_quantizers(act_quant, wts_quant)
        self.train(module.training)

    def attach_quantizers(self, act_quant: ActULQ | None, wts_quant: nn.Module | None) -> None:
        """Add the quantizers (module docstring) to this layer, whose hyper-parameters and
        weights are set. Layer 0's input quantizer is ``act_quant`` (it may be shared with other
        readers of that tensor); deeper layers' inputs and every hidden state get their own,
        with its settings; each weight a copy of ``wts_quant``. None and None: no quantizer."""
        self.suffixes = cell_suffixes(self.num_layers, self.bidirectional)
        self.sparsity = None  # nothing else than quantization compresses a recurrent layer
        self.large = None
        if act_quant is None:
            self.x_quant, self.h_quant, self.wts_quant = nn.ModuleDict(), nn.ModuleDict(), nn.ModuleDict()
            return
        hq = {s: ActULQ(fixed_min=False, batch_num=act_quant.batch_num, fmt=act_quant.format) for s in self.suffixes}
        xq = {"l0": act_quant}
        for k in range(1, self.num_layers):
            xq[f"l{k}"] = ActULQ(fixed_min=False, batch_num=act_quant.batch_num, fmt=act_quant.format)
        self.x_quant = nn.ModuleDict(xq)
        self.h_quant = nn.ModuleDict(hq)
        wq = {}
        for name in self.weight_names():
            q = copy.deepcopy(wts_quant)
            if hasattr(q, "bind"):
                q.bind(0, 1)  # rows: one per gate and hidden unit
            if isinstance(q, WeightULQ) and not q.is_initialized:
                q.init_from(getattr(self, name).detach())
            wq[name] = q
        self.wts_quant = nn.ModuleDict(wq)
        device = getattr(self, self.weight_names()[0]).device
        for m in (self.x_quant, self.h_quant, self.wts_quant):
            m.to(device)

    @classmethod
    def from_parts(cls, module: nn.Module, parts: LayerParts) -> RecurrentLayer:
        why = unsupported(module)
        if why is not None:
            raise ValueError(f"module: {why}")
        extra = [f for f in ("bn", "sparsity", "out_quant") if getattr(parts, f) is not None]
        if extra or parts.masks or parts.act_quant is None or parts.wts_quant is None:
            raise ValueError(f"{type(module).__name__}: only input and weight quantization apply to a recurrent "
                             f"layer (got {', '.join(extra + list(parts.masks)) or 'no quantizers'})")
        return cls(module, parts.act_quant, parts.wts_quant)

    def weight_names(self) -> list[str]:
        return [f"weight_{w}_{s}" for s in self.suffixes for w in ("ih", "hh")]

    @property
    def act_quant(self) -> ActULQ | None:
        """The input quantizer (layer 0's), as a CompressedLayer names it."""
        return self.x_quant["l0"] if "l0" in self.x_quant else None

    def quantizers_pending(self) -> bool:
        """True until every activation quantizer has its clips."""
        return not all(bool(q.initialized) for q in (*self.x_quant.values(), *self.h_quant.values()))

    def quantized_weight(self, name: str) -> Tensor | None:
        p = getattr(self, name, None)
        q = self.wts_quant[name] if name in self.wts_quant else None
        return p if p is None or q is None else q(p)

    def forward(self, input: Tensor, hx=None):
        x, hx, unbatched = check_input(self, input, hx)
        init = not graph_mode() and any(not q.is_initialized for q in self.h_quant.values())
        if init:  # the states' ranges come from whole sequences run unquantized (module docstring)
            def quant_h(sfx, h):
                return h

            def seen(sfx, fed):
                q = self.h_quant[sfx]
                if not q.is_initialized:
                    with torch.no_grad():
                        q(torch.stack(fed).detach())
        else:
            def quant_h(sfx, h):
                return self.h_quant[sfx](h)
            seen = None
        out = run_recurrent(self, x, hx, self.quantized_weight, lambda k, t: self.x_quant[f"l{k}"](t), quant_h, seen)
        return squeeze_output(out, self.mode == "LSTM", self.batch_first) if unbatched else out

    @torch.no_grad()
    def weight_scales(self, name: str) -> Tensor:
        return self.wts_quant[name].scales(getattr(self, name).detach())

    def extra_repr(self) -> str:
        return (f"{self.mode}: {self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"batch_first={self.batch_first}, bidirectional={self.bidirectional}")
