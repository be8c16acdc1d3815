"""MoE routed experts: whole experts removed, the router's rows with them, the top-k lowered where
fewer experts than it remain. Hidden in/out never changes; shared (always-active) experts are not
routed, so never touched.

Two layouts: a block with a ``gate`` router returning ``(logits, weights, indices)`` over fused
expert tensors whose first axis is the expert (Hugging Face Mixtral, Qwen2-MoE, OLMoE, ...), and
a block with a ``gate`` Linear over an ``experts`` ModuleList (hand-written and older models).

Criteria (higher = keep): ``activation_count`` the routing weight mass an expert receives on the
calibration tokens; ``mass_variance`` the mass on layers up to ``boundary``, and beyond it the
energy of the expert's weighted output (``variance_score``: ``cond`` its sum of squares, ``peak``
its largest token, ``cvxpeak`` the mean of both, each scaled to its layer's maximum);
``output_merge`` keeps by mass and folds each dropped expert into the kept one whose output is
nearest on the dropped expert's tokens (mass-weighted mean of their weights), per layer only
where that reproduces the block's output better than dropping (``selector="calib_nll"``).
"""

from __future__ import annotations

import contextlib
import copy
import re

import torch
from torch import nn

from openamct.pruning.domains._common import (
    forward_all,
    hooks,
    keep_index,
    rewrite_config,
    set_param,
)
from openamct.pruning.domains.base import Unit

COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "n_experts")
TOPK_FIELDS = ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts")


def _layout(block) -> str | None:
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if isinstance(gate, nn.Linear) and isinstance(experts, nn.ModuleList) and len(experts) == gate.out_features:
        return "list"
    w = getattr(gate, "weight", None)
    if (experts is not None and isinstance(w, nn.Parameter) and w.dim() == 2 and hasattr(gate, "top_k")
            and any(p.dim() == 3 and p.shape[0] == w.shape[0] for p in experts.parameters(recurse=False))):
        return "fused"
    return None


def _n_experts(block) -> int:
    return block.gate.weight.shape[0]


def _top_k(block) -> int:
    for obj in (block.gate, block):
        for attr in ("top_k", "num_experts_per_tok"):
            if isinstance(getattr(obj, attr, None), int):
                return getattr(obj, attr)
    return 1


def _route(block, hidden, keep=None):
    """(weights [T, E] after top-k, dense) for hidden states [T, H], as the block routes them."""
    if _layout(block) == "fused":
        _, w, idx = block.gate(hidden)
        if keep is not None:
            raise AssertionError("masked routing is the router hook's")
        return torch.zeros(hidden.shape[0], _n_experts(block), dtype=w.dtype).scatter_add_(1, idx, w)
    probs = torch.softmax(block.gate(hidden).float(), -1)
    v, i = torch.topk(probs, min(_top_k(block), probs.shape[-1]), -1)
    return torch.zeros_like(probs).scatter_add_(1, i, v)


def _expert_out(block, e: int, h: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s (unweighted) output on tokens ``h`` [n, H]."""
    if _layout(block) == "list":
        return block.experts[e](h)
    n = h.shape[0]
    return block.experts(h, torch.full((n, 1), e, dtype=torch.long), torch.ones(n, 1, dtype=h.dtype))


class MoeDomain:
    name = "moe"

    def __init__(self):
        self.options: dict = {}  # boundary, variance_score, selector
        self.warnings: list[str] = []
        self.choices: list[tuple[str, str]] = []  # output_merge: (block, "merge" | "drop")
        self._units: dict[str, Unit] = {}

    def units(self, model, example_inputs) -> list[Unit]:
        found = []
        for order, (path, block) in enumerate((p, m) for p, m in model.named_modules() if _layout(m)):
            n = _n_experts(block)
            per = sum(p.numel() for p in block.experts.parameters()) // n + block.gate.weight.shape[1]
            digits = re.findall(r"\.(\d+)\.", f".{path}.")
            prefix = f"{path}." if path else ""
            found.append(Unit(path, n, per, (f"{prefix}gate", f"{prefix}experts"),
                              {"layer": int(digits[-1]) if digits else order, "min_keep": 1}))
        self._units = {u.name: u for u in found}
        return found

    def _collect(self, model, units, data, want_outputs: bool):
        """Per unit: mass [E], and with outputs, energy (sum of squares) and peak [E] of each
        expert's weighted output over the tokens routed to it; and the block inputs."""
        acc = {u.name: {"mass": 0.0, "cond": 0.0, "peak": 0.0, "inputs": []} for u in units}

        def make(name):
            def pre(block, args):
                h = args[0].detach().reshape(-1, args[0].shape[-1])
                w = _route(block, h).double()
                a = acc[name]
                a["mass"] = a["mass"] + w.sum(0)
                a["inputs"].append(h)
                if want_outputs:
                    cond, peak = torch.zeros(w.shape[1], dtype=torch.float64), torch.zeros(w.shape[1], dtype=torch.float64)
                    for e in range(w.shape[1]):
                        rows = torch.nonzero(w[:, e] > 0).flatten()
                        if len(rows):
                            y = (_expert_out(block, e, h[rows]).double() * w[rows, e, None]).pow(2).sum(-1)
                            cond[e], peak[e] = y.sum(), y.max().sqrt()
                    a["cond"] = a["cond"] + cond
                    a["peak"] = torch.maximum(torch.as_tensor(a["peak"], dtype=torch.float64), peak)
            return pre

        with hooks([model.get_submodule(u.name).register_forward_pre_hook(make(u.name)) for u in units]):
            forward_all(model, data)
        return acc

    def _variance_layers(self, units, acc) -> set[str]:
        b = self.options.get("boundary", 10)
        if b == "auto":  # variance where the mass says little: a layer whose experts get near-equal mass
            return {u.name for u in units if float(acc[u.name]["mass"].std() / acc[u.name]["mass"].mean()) < 0.1}
        if isinstance(b, (list, tuple)):
            return {u.name for u in units if u.extra["layer"] in b}
        return {u.name for u in units if u.extra["layer"] > b}

    def scores(self, model, units, data, criterion: str) -> dict[str, torch.Tensor]:
        variance = criterion == "mass_variance"
        acc = self._collect(model, units, data, want_outputs=variance)
        out = {u.name: torch.as_tensor(acc[u.name]["mass"], dtype=torch.float64) for u in units}
        if variance:
            how = self.options.get("variance_score", "cond")
            for name in self._variance_layers(units, acc):
                cond, peak = acc[name]["cond"], acc[name]["peak"]
                cond, peak = cond / cond.max().clamp_min(1e-30), peak / peak.max().clamp_min(1e-30)
                out[name] = {"cond": cond, "peak": peak, "cvxpeak": (cond + peak) / 2}[how]
        return {n: s.float() for n, s in out.items()}

    def masked(self, model, keep: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
        handles = []
        for name, k in keep.items():
            block = model.get_submodule(name)
            kept = k.to(torch.bool)
            if _layout(block) == "list":
                def post(_m, _a, logits, kept=kept):
                    return logits.masked_fill(~kept.to(logits.device), float("-inf"))
            else:
                top_k, norm = _top_k(block), getattr(block.gate, "norm_topk_prob", True)

                def post(_m, _a, out, kept=kept, top_k=top_k, norm=norm):
                    logits = out[0].masked_fill(~kept.to(out[0].device), float("-inf"))
                    probs = torch.softmax(logits.float(), -1)
                    v, i = torch.topk(probs, min(top_k, int(kept.sum())), -1)
                    if norm:
                        v = v / v.sum(-1, keepdim=True)
                    return (logits, v.to(out[1].dtype), i)
            handles.append(block.gate.register_forward_hook(post))
        return hooks(handles)

    def _cut(self, block, idx) -> None:
        k = len(idx)
        if _layout(block) == "list":
            block.experts = nn.ModuleList([block.experts[int(i)] for i in idx])
            set_param(block.gate, "weight", block.gate.weight[idx])
            if block.gate.bias is not None:
                set_param(block.gate, "bias", block.gate.bias[idx])
            block.gate.out_features = k
        else:
            n = _n_experts(block)
            for mod in (block.experts, block.gate):
                for pname, p in list(mod.named_parameters(recurse=False)):
                    if p.shape and p.shape[0] == n:
                        set_param(mod, pname, p[idx])
                for bname, b in list(mod.named_buffers(recurse=False)):
                    if b is not None and b.shape and b.shape[0] == n:
                        setattr(mod, bname, b[idx].clone())
        for obj in (block, block.gate, block.experts):
            if isinstance(getattr(obj, "num_experts", None), int):
                obj.num_experts = k
            for attr in ("top_k", "num_experts_per_tok"):
                if isinstance(getattr(obj, attr, None), int) and getattr(obj, attr) > k:
                    setattr(obj, attr, k)

    def _merge(self, block, idx, mass, inputs) -> None:
        """Fold each dropped expert into its nearest kept one, in place (before the cut)."""
        h = torch.cat(inputs)
        w = _route(block, h)
        kept = [int(i) for i in idx]
        for d in sorted(set(range(_n_experts(block))) - set(kept)):
            rows = torch.nonzero(w[:, d] > 0).flatten()
            if not len(rows):
                continue
            ref = _expert_out(block, d, h[rows])
            k = min(kept, key=lambda e: float((_expert_out(block, e, h[rows]) - ref).pow(2).sum()))
            a, b = float(mass[k]), float(mass[d])
            if a + b <= 0:
                continue
            if _layout(block) == "list":
                for pk, pd in zip(block.experts[k].parameters(), block.experts[d].parameters()):
                    pk.copy_((a * pk + b * pd) / (a + b))
            else:
                for p in block.experts.parameters(recurse=False):
                    if p.dim() and p.shape[0] == w.shape[1]:
                        p[k] = (a * p[k] + b * p[d]) / (a + b)

    def apply(self, model, keep: dict[str, torch.Tensor], data, *, reconstruct: bool) -> None:
        if not self._units:
            self.units(model, data[0] if data else None)
        units = [self._units[n] for n in keep]
        acc = self._collect(model, units, data, want_outputs=False) if reconstruct else {}
        counts, tops = set(), set()
        with torch.no_grad():
            for u in units:
                block, idx = model.get_submodule(u.name), keep_index(keep[u.name])
                counts.add(len(idx))
                if len(idx) < u.size and reconstruct:
                    self._merge_or_drop(u.name, block, idx, acc[u.name])
                if len(idx) < u.size:
                    self._cut(block, idx)
                tops.add(_top_k(block))
        if len({u.size for u in units}) == 1 and len(units) == len(self._units):
            rewrite_config(model, COUNT_FIELDS, units[0].size, counts, "MoE experts", self.warnings)
        config = getattr(model, "config", None)
        for f in TOPK_FIELDS:  # lowered to the thinnest layer, so that every layer can route
            if config is not None and isinstance(getattr(config, f, None), int) and getattr(config, f) > min(counts):
                setattr(config, f, min(counts))

    def _merge_or_drop(self, block_name, block, idx, acc) -> None:
        if self.options.get("selector", "calib_nll") == "none":
            self._merge(block, idx, acc["mass"], acc["inputs"])
            self.choices.append((block_name, "merge"))
            return
        h = torch.cat(acc["inputs"])[None]

        def out(b):
            y = b(h)
            return y[0] if isinstance(y, tuple) else y

        ref = out(block)
        merged = copy.deepcopy(block)  # one block's worth: the merge is kept only if it is closer
        self._merge(merged, idx, acc["mass"], acc["inputs"])
        dropped, trial = copy.deepcopy(block), copy.deepcopy(merged)
        for b in (dropped, trial):
            self._cut(b, idx)
        err_drop, err_merge = (float((out(b) - ref).pow(2).sum()) for b in (dropped, trial))
        if err_merge < err_drop:
            for src, dst in zip(merged.experts.parameters(), block.experts.parameters()):
                dst.copy_(src)
        self.choices.append((block_name, "merge" if err_merge < err_drop else "drop"))
