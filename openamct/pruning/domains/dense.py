"""Dense FFN width: the intermediate channels of an FFN, cut out of its producers' outputs
(``gate_proj``/``up_proj``, BERT's ``intermediate.dense``) and its consumer's input (``down_proj``,
BERT's ``output.dense``) together. Hidden and residual widths never change; attention and expert
FFNs (routed or shared) are not this domain's.

Criteria: ``low_variance`` keeps the channels whose activation (the consumer's input) varies most
on the calibration data; ``reconstruct`` keeps the channels of most output energy (mean square
activation times the squared norm of the consumer column) and, in ``apply``, refits the consumer
by ridge least squares so that its output on the calibration data stays as close as it can
(``recovery="bias"`` folds the cut channels' mean into the consumer's bias instead).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from openamct.pruning.domains._common import (
    StopForward,
    forward_all,
    hooks,
    keep_index,
    rewrite_config,
    set_param,
)
from openamct.pruning.domains.base import Unit

logger = logging.getLogger(__name__)

WIDTH_FIELDS = ("intermediate_size", "ffn_hidden_size", "n_inner")


def _ffns(model: nn.Module):
    """(name, producer paths, consumer path) of every FFN the domain recognises."""
    for path, m in model.named_modules():
        if "expert" in path.lower():
            continue  # routed and shared experts belong to the MoE domain, or stay whole
        prefix = f"{path}." if path else ""
        g, u, d = (getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
        if isinstance(u, nn.Linear) and isinstance(d, nn.Linear) and u.out_features == d.in_features:
            if isinstance(g, nn.Linear) and g.out_features == u.out_features:
                yield path, (f"{prefix}gate_proj", f"{prefix}up_proj"), f"{prefix}down_proj"
            elif g is None:
                yield path, (f"{prefix}up_proj",), f"{prefix}down_proj"
            continue
        inter, out = getattr(m, "intermediate", None), getattr(m, "output", None)
        pi, po = getattr(inter, "dense", None), getattr(out, "dense", None)
        if isinstance(pi, nn.Linear) and isinstance(po, nn.Linear) and pi.out_features == po.in_features:
            yield f"{prefix}intermediate", (f"{prefix}intermediate.dense",), f"{prefix}output.dense"


class DenseDomain:
    name = "dense"

    def __init__(self):
        self.options: dict = {}  # the method's kwargs (ridge, recovery)
        self.warnings: list[str] = []
        self._units: dict[str, Unit] = {}

    def units(self, model, example_inputs) -> list[Unit]:
        found = []
        for name, producers, consumer in _ffns(model):
            mods = [model.get_submodule(p) for p in producers]
            down = model.get_submodule(consumer)
            per = sum(p.in_features + (p.bias is not None) for p in mods) + down.out_features
            found.append(Unit(name, down.in_features, per, (*producers, consumer),
                              {"producers": producers, "consumer": consumer}))
        self._units = {u.name: u for u in found}
        return found

    def _stats(self, model, units, data, *, gram_rows: torch.Tensor | None = None):
        """Per unit: count, sum and sum of squares of the consumer's input channels, and with
        ``gram_rows`` the rows ``gram_rows`` of X^T X, X with a constant column appended (what the
        least squares reads: only the kept rows, never the whole square). Float64: the sums run
        over every token of the calibration data."""
        gram = gram_rows is not None
        acc = {}

        def make(unit, last):
            def pre(_mod, args):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                a = acc.get(unit.name)
                if a is None:
                    n = x.shape[1] + 1
                    a = acc[unit.name] = {"n": 0, "s": x.new_zeros(n - 1), "ss": x.new_zeros(n - 1),
                                          "g": x.new_zeros(len(gram_rows), n) if gram else None}
                a["n"] += x.shape[0]
                a["s"] += x.sum(0)
                a["ss"] += (x * x).sum(0)
                if gram:  # in place: the [in + 1]^2 float64 sum is the largest thing pruning holds
                    xa = torch.cat([x, torch.ones_like(x[:, :1])], 1)
                    a["g"].addmm_(xa[:, gram_rows].T, xa)
                if last:
                    raise StopForward
            return pre

        with hooks([model.get_submodule(u.extra["consumer"]).register_forward_pre_hook(make(u, gram))
                    for u in units]):
            forward_all(model, data, stop_early=gram)
        missing = [u.name for u in units if u.name not in acc]
        if missing:
            raise ValueError(f"dense pruning: the calibration data never reaches {missing}")
        return acc

    def scores(self, model, units, data, criterion: str) -> dict[str, torch.Tensor]:
        acc = self._stats(model, units, data)
        out = {}
        for u in units:
            a = acc[u.name]
            mean, msq = a["s"] / a["n"], a["ss"] / a["n"]
            if criterion == "low_variance":
                s = (msq - mean * mean).clamp_min(0)
            else:  # reconstruct: the channel's share of the consumer's output energy
                w = model.get_submodule(u.extra["consumer"]).weight.detach().double()
                s = msq * (w * w).sum(0)
            out[u.name] = s.float()
        return out

    def masked(self, model, keep: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
        handles = []
        for name, k in keep.items():
            mask = k.to(torch.float32)

            def pre(_mod, args, mask=mask):
                return (args[0] * mask.to(args[0].dtype), *args[1:])

            handles.append(model.get_submodule(self._units[name].extra["consumer"]).register_forward_pre_hook(pre))
        return hooks(handles)

    def _refit(self, model, unit, idx, data, recovery: str):
        """The consumer's new weight (and bias) on the kept channels, or None for a plain slice."""
        down = model.get_submodule(unit.extra["consumer"])
        w = down.weight.detach().double()
        if recovery == "bias":
            if down.bias is None:
                self.warnings.append(f"{unit.name}: recovery='bias' needs a consumer bias; sliced instead")
                return None
            a = self._stats(model, [unit], data)[unit.name]
            cut = torch.ones(w.shape[1], dtype=torch.bool)
            cut[idx] = False
            return w[:, idx], down.bias.detach().double() + w[:, cut] @ (a["s"] / a["n"])[cut]
        n_in = w.shape[1]
        has_bias = down.bias is not None
        b = down.bias.detach().double() if has_bias else torch.zeros(w.shape[0], dtype=torch.float64)
        wa = torch.cat([w, b[:, None]], 1)  # [out, in + 1]: the bias as the constant column's weight
        rows = torch.cat([idx, torch.tensor([n_in])]) if has_bias else idx
        g = self._stats(model, [unit], data, gram_rows=rows)[unit.name]["g"]  # [rows, in + 1]
        gkk = g[:, rows]
        ridge = float(self.options.get("ridge", 1e-2)) * gkk.diagonal()[: len(idx)].mean().clamp_min(1e-12)
        reg = torch.zeros(len(rows), dtype=torch.float64)
        reg[: len(idx)] = ridge  # the bias is never shrunk
        sol = torch.linalg.solve(gkk + torch.diag(reg), g @ wa.T)  # [len(rows), out]
        return (sol[: len(idx)].T, sol[len(idx)]) if has_bias else (sol.T, None)

    def apply(self, model, keep: dict[str, torch.Tensor], data, *, reconstruct: bool) -> None:
        if not self._units:
            self.units(model, data[0] if data else None)
        recovery = self.options.get("recovery", "ls") if reconstruct else "none"
        widths, old = set(), set()
        with torch.no_grad():
            for name, k in keep.items():
                unit = self._units[name]
                idx = keep_index(k)
                old.add(unit.size)
                widths.add(len(idx))
                if len(idx) == unit.size:
                    continue
                fit = self._refit(model, unit, idx, data, recovery) if recovery != "none" else None
                for p in unit.extra["producers"]:
                    lin = model.get_submodule(p)
                    set_param(lin, "weight", lin.weight[idx])
                    if lin.bias is not None:
                        set_param(lin, "bias", lin.bias[idx])
                    lin.out_features = len(idx)
                down = model.get_submodule(unit.extra["consumer"])
                set_param(down, "weight", fit[0] if fit else down.weight[:, idx])
                if fit and fit[1] is not None:
                    set_param(down, "bias", fit[1])
                down.in_features = len(idx)
        all_units = len(keep) == len(self._units)
        if len(old) == 1 and all_units:
            rewrite_config(model, WIDTH_FIELDS, next(iter(old)), widths, "dense FFN", self.warnings)
        elif len(old) == 1:
            rewrite_config(model, WIDTH_FIELDS, next(iter(old)), widths | old, "dense FFN", self.warnings)
