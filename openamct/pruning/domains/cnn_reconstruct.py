"""Least-squares reconstruction of the consumers whose input channels were cut.

Before the cut, each consumer's output on the calibration data is recorded at a fixed sample of
output positions. After the cut, the consumers are visited in the order the model runs them:
the pruned model runs up to the consumer (stopped there), the consumer's input patches at those
positions are the design matrix ``A``, and the weights over the kept inputs (plus the bias,
where the layer has one) solve

    min ‖A·W − Y‖² + λ‖W − W₀‖²,   λ = ridge · mean(diag(AᵀA))

(``W₀``: the kept weights as they were), so that the consumer's output matches the unpruned one
as closely as a linear map over what is left can. The ridge pulls towards the old weights, not
to zero, so a channel the data never excites keeps its weight. Each consumer is solved on the
input the already-reconstructed layers before it produce, so the errors do not add up.

A grouped conv is solved block by block (group ``b``'s outputs read only its inputs). Conv1d,
Conv2d and Linear consumers are reconstructed; any other consumer keeps its cut weights (one
WARNING).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from openamct.log_summary import warn_grouped

logger = logging.getLogger(__name__)

__all__ = ["Targets", "call_model", "fold_means", "input_means", "joined", "record_targets", "reconstruct"]

SAMPLES = 512  # output positions sampled per calibration batch and consumer


class _Stop(Exception):
    """Raised in a consumer's hook once its input is captured: the rest of the forward is not needed."""


def call_model(model: nn.Module, x) -> object:
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def _supported(m: nn.Module) -> bool:
    return isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear)) and type(m).forward in (
        nn.Conv1d.forward, nn.Conv2d.forward, nn.Linear.forward)


def _rows(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The consumer's input as one row per output position: [batch, positions, features]."""
    if isinstance(m, nn.Linear):
        return x.reshape(x.shape[0], -1, x.shape[-1])
    if isinstance(m, nn.Conv1d):
        x = x.unsqueeze(-2)
    mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
    pad = m._reversed_padding_repeated_twice  # torch's own padding of this conv (ints or 'same')
    if isinstance(m, nn.Conv1d):
        pad = [pad[0], pad[1], 0, 0]
    x = F.pad(x, list(pad), mode=mode) if any(pad) else x
    kernel = m.kernel_size if isinstance(m, nn.Conv2d) else (1, m.kernel_size[0])
    stride = m.stride if isinstance(m, nn.Conv2d) else (1, m.stride[0])
    dilation = m.dilation if isinstance(m, nn.Conv2d) else (1, m.dilation[0])
    return F.unfold(x, kernel, dilation=dilation, stride=stride).transpose(1, 2)  # [N, L, Cin/g·k·k ·g]


def _outputs(m: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """The consumer's output as [batch, positions, channels]."""
    if isinstance(m, nn.Linear):
        return y.reshape(y.shape[0], -1, y.shape[-1])
    return y.reshape(y.shape[0], y.shape[1], -1).transpose(1, 2)


class Targets:
    """Each consumer's original outputs at sampled positions, per calibration batch."""

    def __init__(self) -> None:
        self.index: dict[str, list[torch.Tensor]] = {}  # consumer -> per batch: sampled positions
        self.outputs: dict[str, list[torch.Tensor]] = {}  # consumer -> per batch: [N, samples, Cout]


def record_targets(model: nn.Module, consumers: list[str], data: list) -> Targets:
    """Run the unpruned model over ``data`` and keep each consumer's outputs at sampled positions."""
    modules, t = dict(model.named_modules()), Targets()
    batch = [0]
    hooks = []

    def keep(name: str):
        def hook(m, args, out):
            y = _outputs(m, out.detach())
            g = torch.Generator().manual_seed(batch[0] * 7919 + len(name))
            idx = torch.randperm(y.shape[1], generator=g)[:SAMPLES].sort().values.to(y.device)
            t.index.setdefault(name, []).append(idx)
            t.outputs.setdefault(name, []).append(y.index_select(1, idx))
        return hook

    try:
        for name in consumers:
            hooks.append(modules[name].register_forward_hook(keep(name)))
        with torch.no_grad():
            for i, x in enumerate(data):
                batch[0] = i
                call_model(model, x)
    finally:
        for h in hooks:
            h.remove()
    return t


def _solve(a_rows: list[torch.Tensor], y_rows: list[torch.Tensor], w0: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin ‖A·W − Y‖² + λ‖W − W₀‖² over W (features × outputs), in float64."""
    gram = sum(a.T @ a for a in a_rows)
    rhs = sum(a.T @ y for a, y in zip(a_rows, y_rows, strict=True))
    rows = sum(a.shape[0] for a in a_rows)
    # few rows for many unknowns (a deep layer's small feature map) would fit the calibration
    # data exactly and little else: the pull towards the old weights grows with unknowns / rows
    lam = ridge * max(1.0, gram.shape[0] / rows) * float(gram.diagonal().mean().clamp_min(1e-12))
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    lhs, rhs = gram + lam * eye, rhs + lam * w0
    chol, info = torch.linalg.cholesky_ex(lhs)
    return torch.cholesky_solve(rhs, chol) if int(info) == 0 else torch.linalg.solve(lhs, rhs)


def _capture(model: nn.Module, m: nn.Module, data: list, index: list[torch.Tensor]) -> list[torch.Tensor]:
    """The pruned model's input rows of ``m`` at the recorded positions, per batch (float64)."""
    rows: list[torch.Tensor] = []

    def hook(mod, args):
        r = _rows(mod, args[0].detach())
        rows.append(r.index_select(1, index[len(rows)]).to(torch.float64))
        raise _Stop

    h = m.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for x in data:
                try:
                    call_model(model, x)
                except _Stop:
                    pass
    finally:
        h.remove()
    return rows


def _solve_layer(m: nn.Module, rows: list[torch.Tensor], ys: list[torch.Tensor], out_keep: torch.Tensor | None,
                 ridge: float, sink: nn.Module | None = None) -> None:
    """Write the least-squares weights (and bias) of consumer ``m`` from its input rows and its
    original outputs at the same positions, one pair per batch. ``sink``: the BatchNorm after a
    consumer without a bias, which takes the bias into its running mean."""
    if out_keep is not None:
        ys = [y.index_select(2, out_keep.to(y.device)) for y in ys]
    ys = [y.to(torch.float64) for y in ys]
    w = m.weight.detach()
    groups = getattr(m, "groups", 1)
    cout = w.shape[0]
    flat = w.reshape(cout, -1).to(torch.float64)  # [Cout, Cin/g · k]
    cols, cout_g = flat.shape[1], cout // groups
    new_w, new_b = [], []
    for b in range(groups):
        a = [r[:, :, b * cols:(b + 1) * cols].reshape(-1, cols) for r in rows]
        y = [v[:, :, b * cout_g:(b + 1) * cout_g].reshape(-1, cout_g) for v in ys]
        w0 = flat[b * cout_g:(b + 1) * cout_g].T
        if m.bias is not None or sink is not None:  # a ones column: the removed channels' mean moves there
            a = [torch.cat([v, torch.ones_like(v[:, :1])], 1) for v in a]
            b0 = m.bias.detach()[b * cout_g:(b + 1) * cout_g] if m.bias is not None else w0.new_zeros(cout_g)
            w0 = torch.cat([w0, b0.to(torch.float64)[None]], 0)
        sol = _solve(a, y, w0, ridge)
        new_w.append(sol[:cols].T)
        if sol.shape[0] > cols:
            new_b.append(sol[cols])
    with torch.no_grad():
        m.weight.copy_(torch.cat(new_w, 0).reshape(w.shape).to(w.dtype))
        if m.bias is not None:
            m.bias.copy_(torch.cat(new_b, 0).to(m.bias.dtype))
        elif sink is not None:
            _into_running_mean(sink, torch.cat(new_b, 0))


def _into_running_mean(bn: nn.Module, bias: torch.Tensor) -> None:
    """BatchNorm(y + b) in eval mode is BatchNorm(y) with running_mean − b."""
    bn.running_mean.sub_(bias.to(bn.running_mean.device, bn.running_mean.dtype))


def _inline(model: nn.Module, names: list[str], x, t: Targets, out_keep: dict[str, torch.Tensor],
            ridge: float, sinks: dict[str, nn.Module]) -> None:
    """One calibration batch: a single forward in which each consumer is solved in its own
    pre-hook, before it runs, so the layers after it already see its new output."""
    modules = dict(model.named_modules())

    def solve(name: str):
        def pre(mod, args):
            r = _rows(mod, args[0].detach()).index_select(1, t.index[name][0]).to(torch.float64)
            _solve_layer(mod, [r], t.outputs[name], out_keep.get(name), ridge, sinks.get(name))
        return pre

    handles = [modules[n].register_forward_pre_hook(solve(n)) for n in names]
    try:
        with torch.no_grad():
            call_model(model, x)
    finally:
        for h in handles:
            h.remove()


def reconstruct(model: nn.Module, order: list[str], data: list, t: Targets,
                out_keep: dict[str, torch.Tensor], ridge: float, sinks: dict[str, nn.Module]) -> int:
    """Solve every consumer in ``order`` (execution order) on the pruned ``model``; ``out_keep``
    gives the kept output rows of the consumers that also lost outputs, ``sinks`` the BatchNorm
    that takes the bias of a consumer without one. Returns how many were solved."""
    modules = dict(model.named_modules())
    names, skipped = [], []
    for name in order:
        m = modules[name]
        if _supported(m):
            names.append(name)
        else:
            skipped.append((name, f"a {type(m).__name__} consumer keeps its cut weights (least squares is done "
                                  "for Conv1d, Conv2d and Linear)"))
    warn_grouped(logger, "reconstruct: layer(s) not reconstructed", skipped)
    if len(data) == 1:
        _inline(model, names, data[0], t, out_keep, ridge, sinks)
        return len(names)
    for name in names:  # several batches: one pass per consumer, each stopped at that consumer
        rows = _capture(model, modules[name], data, t.index[name])
        if len(rows) != len(data):
            raise RuntimeError(f"reconstruct: layer {name!r} did not run on every calibration batch")
        _solve_layer(modules[name], rows, t.outputs[name], out_keep.get(name), ridge, sinks.get(name))
    return len(names)


def joined(data: list) -> list:
    """The calibration batches as one batch where they are tensors that concatenate (the
    reconstruction then takes a single forward), else as they are."""
    if len(data) > 1 and all(isinstance(x, torch.Tensor) for x in data) and \
            len({(x.dim(), tuple(x.shape[1:]), x.dtype, x.device) for x in data}) == 1 and data[0].dim() > 0:
        return [torch.cat(data, 0)]
    return list(data)


def input_means(model: nn.Module, names: list[str], data: list) -> dict[str, torch.Tensor]:
    """Per consumer, the mean of each input channel position over the calibration data (float64)."""
    modules, sums = dict(model.named_modules()), {}

    def hook(name: str):
        def pre(mod, args):
            x = args[0].detach().to(torch.float64)
            axis = x.dim() - 1 if isinstance(mod, nn.Linear) else 1
            x = x.movedim(axis, -1).reshape(-1, x.shape[axis])
            n, s = sums.get(name, (0, 0))
            sums[name] = (n + x.shape[0], s + x.sum(0))
        return pre

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            for x in data:
                call_model(model, x)
    finally:
        for h in handles:
            h.remove()
    return {n: s / n_rows for n, (n_rows, s) in sums.items()}


def fold_means(m: nn.Module, cut: list[int], mean: torch.Tensor, sink: nn.Module | None = None) -> None:
    """``recovery='bias'``: the cut input positions of consumer ``m`` become constants at their
    calibration mean, added to its bias (before the columns are removed), or subtracted from
    the running mean of ``sink``, the BatchNorm after a consumer without a bias. A conv's
    border, where padding reads zeros, is treated like its interior."""
    w = m.weight.detach().to(torch.float64)
    groups = getattr(m, "groups", 1)
    cin_g, cout_g = w.shape[1], w.shape[0] // groups
    delta = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
    for p in cut:
        b, local = divmod(p, cin_g) if groups > 1 else (0, p)
        rows = slice(b * cout_g, (b + 1) * cout_g) if groups > 1 else slice(None)
        col = w[rows, local].reshape(w[rows].shape[0], -1).sum(1)
        delta[rows] += col * float(mean[p])
    with torch.no_grad():
        if m.bias is not None:
            m.bias.add_(delta.to(m.bias.dtype))
        else:
            _into_running_mean(sink, delta)
