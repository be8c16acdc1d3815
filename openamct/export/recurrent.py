"""Export forms of a ``RecurrentLayer`` (a quantized LSTM/GRU).

- Fake-quant model (``RecurrentFake``): the recurrence unrolled over the traced sequence length,
  step by step as in training (``compressed.recurrent.run_recurrent``): fake-quantized float
  weights, the six-op ``FakeQuantAct`` on each layer's input and on the hidden state before every
  recurrent matmul. It reproduces the trained model; its sequence length is the one of
  ``input_data`` (the loop is unrolled).
- Deploy model (``RecurrentDeploy``): one ONNX ``LSTM``/``GRU`` node per layer (both directions
  in one node) reading its weights as ``DequantizeLinear`` of int8 initializers, one per gate
  block (``<layer>.weight_ih_l0_g0_int8``..., ONNX's gate order), per row (one scale per gate and
  hidden unit, zero point 0), concatenated to ONNX's [directions, rows, cols]; its input
  through the layer's uint8 QuantizeLinear -> DequantizeLinear. Standard ONNX (opset 14+ LSTM/GRU, per-axis DQ): ONNX
  Runtime and OpenVINO run it, any sequence length. The hidden state is not quantized there (an
  ONNX LSTM has no hook between steps): the one departure from the fake-quant model.
  ``recurrent_onnx.dynamic_quantize_lstm`` rewrites its LSTMs into ORT's integer
  ``DynamicQuantizeLSTM`` contrib op.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn
from torch.autograd import Function

from openamct.compressed.recurrent import (
    GATES,
    RecurrentLayer,
    check_input,
    run_recurrent,
    squeeze_output,
)
from openamct.export.element_types import storage_dtype
from openamct.export.export_layer import QDQAct, WeightDQ
from openamct.module_tree import set_module

__all__ = ["RecurrentFake", "RecurrentDeploy", "fold_recurrent", "has_recurrent", "ONNX_GATE_ORDER"]

# Gate blocks of ONNX's weight layout, as indices of torch's: LSTM torch (i, f, g, o) -> ONNX
# (i, o, f, c); GRU torch (r, z, n) -> ONNX (z, r, h).
ONNX_GATE_ORDER = {"LSTM": (0, 3, 1, 2), "GRU": (1, 0, 2)}
HYPER = ("mode", "input_size", "hidden_size", "num_layers", "bias", "batch_first", "bidirectional", "suffixes")


def has_recurrent(model: nn.Module) -> bool:
    return any(isinstance(m, RecurrentLayer) for m in model.modules())


def _gate_blocks(t: Tensor, mode: str, order) -> Tensor:
    return torch.cat([t.chunk(GATES[mode], 0)[i] for i in order])


def _to_onnx(t: Tensor, mode: str) -> Tensor:
    return _gate_blocks(t, mode, ONNX_GATE_ORDER[mode])


def _to_torch(t: Tensor, mode: str) -> Tensor:
    order = ONNX_GATE_ORDER[mode]
    return _gate_blocks(t, mode, [order.index(i) for i in range(len(order))])


class RecurrentFake(nn.Module):
    """The fake-quant model's form of a RecurrentLayer (module docstring)."""

    def __init__(self, layer: RecurrentLayer, make_act) -> None:
        super().__init__()
        for k in HYPER:
            setattr(self, k, getattr(layer, k))
        self.dropout, self.training = 0.0, False
        int4 = {}  # INT4 weights: grid values read through DequantizeLinear (export/int4_onnx.py)
        with torch.no_grad():
            for name, _ in layer.named_parameters(recurse=False):
                value = layer.quantized_weight(name).detach().clone()
                q = layer.wts_quant[name] if name in layer.wts_quant else None
                if q is not None and q.format.bits == 4:
                    s = layer.weight_scales(name).float().reshape(-1)
                    dq = int4[name] = WeightDQ(s.expand(value.shape[0]).clone(), 0, q.format)
                    self.register_buffer(f"{name}_int8", dq.quantize(value))
                    continue
                self.register_buffer(name, value)
        self.int4 = nn.ModuleDict(int4)
        # each quantizer's own format: an INT16 (A16W8) layer clamps to the 16-bit range
        self.x_pre = nn.ModuleDict({k: make_act(*q.scale_offset(), q.format) for k, q in layer.x_quant.items()})
        self.h_pre = nn.ModuleDict({k: make_act(*q.scale_offset(), q.format) for k, q in layer.h_quant.items()})

    def _weight(self, name: str) -> Tensor | None:
        if name in self.int4:
            return self.int4[name](getattr(self, f"{name}_int8"))
        return getattr(self, name, None)

    def forward(self, input: Tensor, hx=None):
        x, hx, unbatched = check_input(self, input, hx)
        out = run_recurrent(self, x, hx, self._weight,
                            lambda k, t: self.x_pre[f"l{k}"](t), lambda s, h: self.h_pre[s](h))
        return squeeze_output(out, self.mode == "LSTM", self.batch_first) if unbatched else out


def _state_inputs(g, x, h0, c0, mode: str) -> list:
    """ONNX LSTM/GRU inputs after B: none when there is no initial state (the optional inputs
    are left off the end); else ``sequence_lens`` (every sequence full: T for each of the B
    batch entries, the same as none) and the initial state."""
    if h0 is None:
        return []
    shape = g.op("Shape", x)  # [T, B, I]
    steps = g.op("Cast", g.op("Gather", shape, g.op("Constant", value_t=torch.tensor(0)), axis_i=0), to_i=6)
    batch = g.op("Gather", shape, g.op("Constant", value_t=torch.tensor([1])), axis_i=0)
    lens = g.op("Expand", steps, batch)  # int32 [B]
    return [lens, h0, c0] if mode == "LSTM" else [lens, h0]


class _RnnOp(Function):
    """One layer (all its directions) of a deploy RecurrentLayer: eager, the float recurrence on
    the dequantized weights; exported, DequantizeLinear -> ONNX LSTM/GRU."""

    @staticmethod
    def forward(ctx, x, h0, c0, bias, mode: str, hidden: int, *wts):
        per = 3 * GATES[mode]  # (int8, scale, zero) per gate block
        dirs = len(wts) // (2 * per)
        mod = SimpleNamespace(mode=mode, batch_first=False, bidirectional=dirs == 2, num_layers=1,
                              hidden_size=hidden, dropout=0.0, training=False)
        params = {}
        for d in range(dirs):
            sfx = "l0_reverse" if d else "l0"
            for i, w in enumerate(("ih", "hh")):
                blocks = wts[(2 * d + i) * per:(2 * d + i + 1) * per]
                dq = torch.cat([q.float() * s[:, None] for q, s in zip(blocks[0::3], blocks[1::3])])
                params[f"weight_{w}_{sfx}"] = _to_torch(dq, mode)
            if bias is not None:
                b_ih, b_hh = bias[d].chunk(2)
                params[f"bias_ih_{sfx}"], params[f"bias_hh_{sfx}"] = _to_torch(b_ih, mode), _to_torch(b_hh, mode)
        hx = None if h0 is None else ((h0, c0) if mode == "LSTM" else h0)
        y, h = run_recurrent(mod, x, hx, params.get, lambda k, t: t, lambda s, t: t)
        return (y, *h) if mode == "LSTM" else (y, h)

    @staticmethod
    def symbolic(g, x, h0, c0, bias, mode: str, hidden: int, *wts):
        per = 3 * GATES[mode]
        dirs = len(wts) // (2 * per)
        axes = g.op("Constant", value_t=torch.tensor([0], dtype=torch.int64))
        ws, rs = [], []
        for d in range(dirs):
            for i, out in enumerate((ws, rs)):
                blocks = wts[(2 * d + i) * per:(2 * d + i + 1) * per]
                # One DequantizeLinear per gate block, concatenated: OpenVINO keeps a
                # DequantizeLinear feeding an op directly (or through an Unsqueeze) as a weight
                # decompression, which its CPU LSTM/GRU refuse (they need constant weights); a
                # Concat of them it folds to a constant at load.
                dq = [g.op("DequantizeLinear", q, s, z, axis_i=0)
                      for q, s, z in zip(blocks[0::3], blocks[1::3], blocks[2::3])]
                out.append(g.op("Unsqueeze", g.op("Concat", *dq, axis_i=0), axes))
        w = ws[0] if dirs == 1 else g.op("Concat", *ws, axis_i=0)
        r = rs[0] if dirs == 1 else g.op("Concat", *rs, axis_i=0)
        # No bias: ONNX's default, zeros, written out.
        b = g.op("Constant", value_t=torch.zeros(dirs, 2 * GATES[mode] * hidden)) if bias is None else bias
        state = _state_inputs(g, x, h0, c0, mode)
        direction = "bidirectional" if dirs == 2 else "forward"
        if mode == "LSTM":
            y, yh, yc = g.op("LSTM", x, w, r, b, *state, hidden_size_i=hidden, direction_s=direction, outputs=3)
        else:
            y, yh = g.op("GRU", x, w, r, b, *state, hidden_size_i=hidden, direction_s=direction,
                         linear_before_reset_i=1, outputs=2)
        # Y [T, D, B, H] -> [T, B, D*H], as torch's output
        y = g.op("Transpose", y, perm_i=[0, 2, 1, 3])
        y = g.op("Reshape", y, g.op("Constant", value_t=torch.tensor([0, 0, -1], dtype=torch.int64)))
        return (y, yh, yc) if mode == "LSTM" else (y, yh)


class _WideQDQ(Function):
    """Per-tensor fake quant of a format wider than 8 bits; exported as ONNX Runtime's
    ``com.microsoft`` QuantizeLinear -> DequantizeLinear with an int16 zero point (the standard
    ops take int16 only from opset 21, which the TorchScript exporter does not write)."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float, zero: int, qmin: int, qmax: int) -> Tensor:
        return (torch.round(x * (1.0 / scale)) + zero).clamp(qmin, qmax).sub(zero).mul(scale)

    @staticmethod
    def symbolic(g, x, scale: float, zero: int, qmin: int, qmax: int):
        s = g.op("Constant", value_t=torch.tensor(scale, dtype=torch.float32))
        z = g.op("Constant", value_t=torch.tensor(zero, dtype=torch.int16))
        return g.op("com.microsoft::DequantizeLinear", g.op("com.microsoft::QuantizeLinear", x, s, z), s, z)


class WideQDQAct(nn.Module):
    """The deploy model's input quantizer of an INT16 (A16W8) recurrent layer: signed 16-bit,
    the trained grid as it is (the LSTM/GRU after it is a float kernel: no uint shift to make)."""

    def __init__(self, scale: float, offset: int, fmt) -> None:
        super().__init__()
        self.scale = float(torch.tensor(scale, dtype=torch.float32))
        self.zero_point, self.qmin, self.qmax = int(offset), fmt.qmin, fmt.qmax

    def forward(self, x: Tensor) -> Tensor:
        return _WideQDQ.apply(x, self.scale, self.zero_point, self.qmin, self.qmax)


class RecurrentDeploy(nn.Module):
    """The deploy model's form of a RecurrentLayer (module docstring)."""

    def __init__(self, layer: RecurrentLayer, x_pre: nn.ModuleDict | None = None) -> None:
        """``x_pre``: the input quantizers' export form, per layer ("l0"...); by default the
        deploy model's uint8 ``QDQAct``."""
        super().__init__()
        for k in HYPER:
            setattr(self, k, getattr(layer, k))
        if x_pre is None:
            x_pre = nn.ModuleDict({k: (QDQAct if q.format.bits <= 8 else WideQDQAct)(*q.scale_offset(), q.format)
                                   for k, q in layer.x_quant.items()})
        self.x_pre = x_pre
        dirs = 1 + int(self.bidirectional)
        with torch.no_grad():
            for k in range(self.num_layers):
                for d in range(dirs):
                    sfx = f"l{k}{'_reverse' if d else ''}"
                    for w in ("ih", "hh"):
                        name = f"weight_{w}_{sfx}"
                        q = layer.wts_quant[name]
                        s = layer.weight_scales(name).float().reshape(-1)
                        fmt = q.format
                        grid = torch.round(layer.quantized_weight(name).detach().float() / s[:, None])
                        grid = grid.clamp(fmt.qmin, fmt.qmax).to(storage_dtype(fmt))
                        blocks = zip(_to_onnx(grid, self.mode).chunk(GATES[self.mode]),
                                     _to_onnx(s, self.mode).chunk(GATES[self.mode]))
                        for j, (qj, sj) in enumerate(blocks):  # ONNX's gate order
                            self.register_buffer(f"{name}_g{j}_int8", qj.contiguous())
                            self.register_buffer(f"{name}_g{j}_scale", sj.contiguous())
                            self.register_buffer(f"{name}_g{j}_zero", torch.zeros(sj.shape, dtype=grid.dtype))
                if self.bias:
                    b = [torch.cat([_to_onnx(getattr(layer, f"bias_{w}_l{k}{'_reverse' if d else ''}").detach(),
                                             self.mode) for w in ("ih", "hh")]) for d in range(dirs)]
                    self.register_buffer(f"bias_l{k}", torch.stack(b).float())

    def forward(self, input: Tensor, hx=None):
        x, hx, unbatched = check_input(self, input, hx)
        lstm = self.mode == "LSTM"
        x = x.transpose(0, 1) if self.batch_first else x
        dirs = 1 + int(self.bidirectional)
        h0, c0 = (hx if lstm else (hx, None)) if hx is not None else (None, None)
        hs, cs = [], []
        for k in range(self.num_layers):
            wts = []
            for d in range(dirs):
                sfx = f"l{k}{'_reverse' if d else ''}"
                for w in ("ih", "hh"):
                    wts += [getattr(self, f"weight_{w}_{sfx}_g{j}_{part}") for j in range(GATES[self.mode])
                            for part in ("int8", "scale", "zero")]
            rows = slice(k * dirs, (k + 1) * dirs)
            out = _RnnOp.apply(self.x_pre[f"l{k}"](x), None if h0 is None else h0[rows],
                               None if c0 is None else c0[rows], getattr(self, f"bias_l{k}", None),
                               self.mode, self.hidden_size, *wts)
            x = out[0]
            hs.append(out[1])
            if lstm:
                cs.append(out[2])
        y = x.transpose(0, 1) if self.batch_first else x
        hn = hs[0] if len(hs) == 1 else torch.cat(hs)
        out = (y, (hn, cs[0] if len(cs) == 1 else torch.cat(cs))) if lstm else (y, hn)
        return squeeze_output(out, lstm, self.batch_first) if unbatched else out


def fold_recurrent(model: nn.Module, make_act=None) -> int:
    """Replace every RecurrentLayer of ``model`` (a working copy) by its fake-quant form
    (``make_act``: the fake-quant activation class) or, without one, its deploy form."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, RecurrentLayer)]
    for name, layer in found:
        layer.eval()
        set_module(model, name, (RecurrentFake(layer, make_act) if make_act is not None
                                 else RecurrentDeploy(layer)).eval())
    return len(found)
