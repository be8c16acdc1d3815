"""The CNN channel domain of ``openamct.prune``: conv output channels, cut in coupled groups.

Units come from openamct's channel-dependency analysis (``cnn_groups``): residual-add groups,
concat consumers and depthwise chains are pruned, where upstream's CNN domain skips them;
``CnnDomain(upstream_rules=True)`` skips them too, to compare the two reaches.

- ``scores``: ``variance`` (and ``reconstruct``, which ranks the same way) is each channel's
  activation variance where the consumers read it, over the calibration data; ``l1`` / ``l2``
  are the producers' filter norms, each producer's norms divided by their mean so that coupled
  producers count alike.
- ``masked``: a forward pre-hook on every consumer zeroes the input positions of the channels
  not kept. That is exactly what removing them does to the consumer, whatever lies between
  (a BatchNorm's shift, a depthwise conv, an add, a concat), so a trial equals ``apply``
  without reconstruction. Per-channel norms that mix channels (LayerNorm, GroupNorm with
  several channels a group) are the exception: removal renormalises over the kept channels.
- ``apply``: ``openamct.sparsity.filter.apply_removal`` cuts every member in place; with
  ``reconstruct=True`` the consumers are then solved by least squares (``cnn_reconstruct``),
  or, with ``options["recovery"] == "bias"``, only the cut channels' calibration mean is folded
  into each consumer's bias. A consumer without a bias hands that bias to the BatchNorm that
  alone reads it (its running mean), so the pruned architecture gains no parameter.
- A unit that passes a grouped conv (``Unit.extra["prune_group"]`` > 1) must lose as many
  channels in each block: a keep mask that does not is evened out by the latest scores, the
  same way in ``masked``, ``apply`` and ``params_removed``.

The domain remembers the units it found per model (weakly: a model that is dropped is
forgotten), since ``masked`` and ``apply`` receive only the keep masks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref

import torch
from torch import nn

from openamct.pruning.domains.base import Unit
from openamct.pruning.domains.cnn_groups import find_units
from openamct.pruning.domains.cnn_reconstruct import (
    call_model,
    fold_means,
    input_means,
    joined,
    record_targets,
)
from openamct.pruning.domains.cnn_reconstruct import reconstruct as reconstruct_consumers
from openamct.sparsity.filter import apply_removal, removal_edits, validate_removal
from openamct.sparsity.group import PruneGroup

logger = logging.getLogger(__name__)

__all__ = ["CRITERIA", "CnnDomain", "cnn_domain"]

# "variance_channel" and "reconstruct" are upstream's CNN method names (both rank by activation
# variance); "variance", "l1" and "l2" name the criterion itself.
CRITERIA = ("variance_channel", "reconstruct", "variance", "l1", "l2")
RECOVERY = ("ls", "bias", "none")


@contextlib.contextmanager
def _evaluating(model: nn.Module):
    """Eval mode and no grad for a calibration pass (BatchNorm statistics must not move);
    the model's own modes come back after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _axis(m: nn.Module, x: torch.Tensor) -> int:
    """The channel axis a consumer reads: features last for Linear, axis 1 for convs."""
    return x.dim() - 1 if isinstance(m, nn.Linear) or hasattr(m, "nx") else 1


class CnnDomain:
    """Conv channels in coupled groups. ``upstream_rules=True`` keeps to upstream's choice of
    groups (no residual add, no concat, no grouped or depthwise conv); ``ridge`` scales the
    least-squares regulariser of ``apply(..., reconstruct=True)``."""

    name = "cnn"

    def __init__(self, upstream_rules: bool = False, ridge: float = 0.1) -> None:
        if not isinstance(upstream_rules, bool):
            raise TypeError(f"upstream_rules must be a bool, got {type(upstream_rules).__name__}")
        if not (isinstance(ridge, (int, float)) and ridge > 0):
            raise ValueError(f"ridge must be a positive number, got {ridge!r}")
        self.upstream_rules = upstream_rules
        self.ridge = float(ridge)
        self.options: dict = {}  # the method's kwargs as the prune config gives them (ridge, recovery)
        self.warnings: list[str] = []  # for the prune report
        self._scores: dict[str, torch.Tensor] = {}  # the latest scores per unit: grouped units rebalance by them
        self._found: weakref.WeakKeyDictionary[nn.Module, dict[str, PruneGroup]] = weakref.WeakKeyDictionary()
        self._last: dict[str, PruneGroup] = {}  # the groups of the latest units() call
        # layer -> the BatchNorm that alone reads its output, per model (and of the latest call)
        self._bn: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()
        self._last_bn: dict[str, str] = {}
        self._changed: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # applied since their units() call

    # -- units ---------------------------------------------------------------------------------
    def units(self, model: nn.Module, example_inputs) -> list[Unit]:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        found, bn_after = find_units(model, example_inputs, self.upstream_rules)
        self._found[model] = self._last = {u.name: g for u, g in found}
        self._bn[model] = self._last_bn = bn_after
        self._changed.discard(model)
        logger.info("cnn domain: %d unit(s), %d channels", len(found), sum(u.size for u, _ in found))
        return [u for u, _ in found]

    def _groups(self, model: nn.Module, names) -> dict[str, PruneGroup]:
        """The cached groups of ``model``; a copy of the model ``units`` ran on (a trial copy)
        uses that model's groups: they name modules by path, and removal checks every size."""
        known = self._found.get(model)
        if known is None and model not in self._changed and self._last:
            modules = dict(model.named_modules())
            if all(m.name in modules or m.is_function or "." in m.name and m.op_type in ("Parameter", "Attribute")
                   for g in self._last.values() for m in g.members()):
                known = self._last
        if known is None:
            raise ValueError("cnn domain: call units(model, example_inputs) on this model first (or again after "
                             "apply, which changes its channels)")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"cnn domain: unknown unit(s) {unknown[:3]}; units are named by their first "
                             f"producer: {sorted(known)[:5]} ...")
        return {n: known[n] for n in names}

    # -- scores --------------------------------------------------------------------------------
    def scores(self, model: nn.Module, units: list[Unit], data: list, criterion: str) -> dict[str, torch.Tensor]:
        if criterion not in CRITERIA:
            raise ValueError(f"cnn domain: criterion must be one of {list(CRITERIA)}, got {criterion!r}")
        groups = self._groups(model, [u.name for u in units])
        if criterion in ("l1", "l2"):
            out = {n: self._norms(model, g, 1 if criterion == "l1" else 2) for n, g in groups.items()}
        elif not data:
            raise ValueError(f"cnn domain: criterion {criterion!r} needs calibration data (a non-empty list of inputs)")
        else:
            out = self._variance(model, groups, data)
        self._scores.update(out)
        return out

    @staticmethod
    def _norms(model: nn.Module, g: PruneGroup, p: int) -> torch.Tensor:
        modules = dict(model.named_modules())
        total = torch.zeros(g.channels, dtype=torch.float64)
        for prod in g.producers:
            w = modules[prod.name].weight.detach().narrow(0, prod.begin, prod.end - prod.begin)
            s = w.reshape(g.channels, -1).to(torch.float64).norm(p=p, dim=1).cpu()
            total += s / s.mean().clamp_min(1e-30)
        return total.float()

    @staticmethod
    def _variance(model: nn.Module, groups: dict[str, PruneGroup], data: list) -> dict[str, torch.Tensor]:
        """Per group channel, the variance of the values its consumers read (over batch and
        positions), averaged over the consumers and a flatten's repeated positions."""
        modules = dict(model.named_modules())
        readers = sorted({m.name for g in groups.values() for m in g.consumers})
        stats: dict[str, list[torch.Tensor]] = {}  # consumer -> [count, sum, sum of squares] per input position

        def hook(name: str):
            def pre(mod, args):
                x = args[0].detach().to(torch.float64)
                x = x.movedim(_axis(mod, x), -1).reshape(-1, x.shape[_axis(mod, x)])
                s = [torch.tensor(float(x.shape[0]), dtype=torch.float64), x.sum(0).cpu(), (x * x).sum(0).cpu()]
                stats[name] = s if name not in stats else [a + b for a, b in zip(stats[name], s, strict=True)]
            return pre

        handles = [modules[n].register_forward_pre_hook(hook(n)) for n in readers]
        try:
            with _evaluating(model):
                for x in data:
                    call_model(model, x)
        finally:
            for h in handles:
                h.remove()
        out = {}
        for name, g in groups.items():
            total, count = torch.zeros(g.channels, dtype=torch.float64), 0
            for m in g.consumers:
                if m.name not in stats:
                    continue
                n, s, sq = stats[m.name]
                var = (sq / n - (s / n) ** 2).clamp_min(0)[m.begin:m.end]
                total += var.reshape(g.channels, m.repeat).mean(1)
                count += 1
            if not count:
                raise ValueError(f"cnn domain: no consumer of unit {name!r} ran on the calibration data")
            out[name] = (total / count).float()
        return out

    # -- keep masks ----------------------------------------------------------------------------
    def _removed(self, model: nn.Module, keep: dict[str, torch.Tensor]) -> list[PruneGroup]:
        """The groups with ``removed`` set from ``keep`` (copies; the cached groups stay clean).
        Checked before anything is touched: sizes, at least one channel kept, grouped convs'
        equal removal per block."""
        if not isinstance(keep, dict):
            raise TypeError(f"keep must be a dict of unit name -> bool tensor, got {type(keep).__name__}")
        groups = self._groups(model, list(keep))
        chosen = []
        for name, mask in keep.items():
            g = groups[name]
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"keep[{name!r}] must be a torch.Tensor, got {type(mask).__name__}")
            if mask.dtype != torch.bool:
                idx = mask.long().flatten().cpu()
                if idx.numel() and (idx.min() < 0 or idx.max() >= g.channels):
                    raise ValueError(f"keep[{name!r}]: indices must be in 0..{g.channels - 1}")
                mask = torch.zeros(g.channels, dtype=torch.bool).index_fill_(0, idx, True)
            if mask.shape != (g.channels,):
                raise ValueError(f"keep[{name!r}] must have shape ({g.channels},), got {tuple(mask.shape)}")
            mask = mask.cpu()
            if not bool(mask.any()):
                raise ValueError(f"keep[{name!r}] keeps no channel; at least one must stay")
            if g.prune_group > 1:
                mask = self._balanced(name, mask, g.prune_group)
            removed = (~mask).nonzero().flatten().tolist()
            if removed:
                chosen.append(dataclasses.replace(g, removed=removed))
        return chosen

    def _balanced(self, name: str, mask: torch.Tensor, blocks: int) -> torch.Tensor:
        """A unit that passes a grouped conv loses as many channels in each of its ``blocks``
        contiguous blocks: each keeps the block average of the mask's kept count (rounded up),
        the best by the latest scores (by the mask, then by position, where none were taken)."""
        blk = mask.numel() // blocks
        per = mask.reshape(blocks, blk).sum(1)
        if bool((per == per[0]).all()):
            return mask
        want = -(-int(per.sum()) // blocks)
        rank = self._scores.get(name)
        rank = rank.float().cpu() if rank is not None and rank.numel() == mask.numel() else torch.zeros(mask.numel())
        rank = rank + mask.float() * (rank.abs().max() + 1) * 2  # the mask's own choice first
        out = torch.zeros_like(mask)
        for b in range(blocks):
            best = torch.topk(rank[b * blk:(b + 1) * blk], want).indices
            out[b * blk + best] = True
        logger.info("cnn domain: unit %r passes a grouped conv; kept %d channels in each of its %d blocks",
                    name, want, blocks)
        return out

    def masked(self, model: nn.Module, keep: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
        chosen = self._removed(model, keep)
        return self._masking(model, chosen)

    @staticmethod
    @contextlib.contextmanager
    def _masking(model: nn.Module, chosen: list[PruneGroup]):
        modules = dict(model.named_modules())
        cut: dict[str, set[int]] = {}
        for g in chosen:
            for m in g.consumers:
                cut.setdefault(m.name, set()).update(m.positions(g.removed))

        def zero(positions: list[int]):
            index = torch.tensor(positions, dtype=torch.long)

            def pre(mod, args):
                x = args[0]
                return (x.index_fill(_axis(mod, x), index.to(x.device), 0), *args[1:])
            return pre

        handles = [modules[n].register_forward_pre_hook(zero(sorted(p))) for n, p in cut.items()]
        try:
            yield model
        finally:
            for h in handles:
                h.remove()

    def params_removed(self, model: nn.Module, keep: dict[str, torch.Tensor]) -> int:
        """The parameters ``apply(model, keep, ...)`` removes, exactly: where a conv loses inputs
        to one unit and outputs to another, ``Unit.params_per_channel`` counts the weights at
        both cuts twice, this counts them once. Changes nothing."""
        removed = 0
        for module, (tensors, _) in removal_edits(model, self._removed(model, keep)):
            for attr, t in tensors.items():
                if isinstance(getattr(module, attr), nn.Parameter):
                    removed += getattr(module, attr).numel() - t.numel()
        return removed

    # -- apply ---------------------------------------------------------------------------------
    def apply(self, model: nn.Module, keep: dict[str, torch.Tensor], data: list, *, reconstruct: bool) -> None:
        chosen = self._removed(model, keep)
        recovery = self.options.get("recovery", "ls") if reconstruct else "none"
        ridge = self.options.get("ridge", self.ridge)
        if recovery not in RECOVERY:
            raise ValueError(f"cnn domain: recovery must be one of {list(RECOVERY)}, got {recovery!r}")
        if not (isinstance(ridge, (int, float)) and ridge > 0):
            raise ValueError(f"cnn domain: ridge must be a positive number, got {ridge!r}")
        if recovery != "none" and not data:
            raise ValueError("cnn domain: reconstruct=True needs calibration data (a non-empty list of inputs)")
        if not chosen:
            return
        validate_removal(model, chosen)
        consumers = list(dict.fromkeys(m.name for g in chosen for m in g.consumers))
        sinks = self._sinks(model, consumers)
        if recovery == "bias":
            self._fold(model, chosen, consumers, data, sinks)
        elif recovery == "ls":
            data = joined(data)
            order = self._run_order(model, consumers, data[0])
            with _evaluating(model):
                targets = record_targets(model, order, data)
        apply_removal(model, chosen, quiet=True)
        self._found.pop(model, None)  # its channels changed: units must be found again
        self._changed.add(model)
        if recovery == "ls":
            with _evaluating(model):
                solved = reconstruct_consumers(model, order, data, targets, _out_keep(model, chosen, order),
                                               float(ridge), sinks)
            logger.info("cnn domain: reconstructed %d consumer(s)", solved)
        logger.info("cnn domain: removed %d channel(s) from %d unit(s)",
                    sum(len(g.removed) for g in chosen), len(chosen))

    def _sinks(self, model: nn.Module, names: list[str]) -> dict[str, nn.Module]:
        """Consumers without a bias whose output a BatchNorm alone reads: a bias the recovery
        finds is subtracted from that BatchNorm's running mean instead (the same function in
        eval mode, and no new parameter the pruned architecture would lack)."""
        bn_after = self._bn.get(model, self._last_bn)
        modules = dict(model.named_modules())
        return {n: modules[bn_after[n]] for n in names
                if getattr(modules[n], "bias", 0) is None and bn_after.get(n) in modules
                and getattr(modules[bn_after[n]], "running_mean", None) is not None}

    def _fold(self, model: nn.Module, chosen: list[PruneGroup], consumers: list[str], data: list,
              sinks: dict[str, nn.Module]) -> None:
        """recovery='bias': each consumer's cut inputs, at their mean, move into its bias."""
        modules = dict(model.named_modules())
        with _evaluating(model):
            means = input_means(model, consumers, data)
        cut: dict[str, set[int]] = {}
        for g in chosen:
            for m in g.consumers:
                cut.setdefault(m.name, set()).update(m.positions(g.removed))
        for name, positions in cut.items():
            if getattr(modules[name], "bias", None) is None and name not in sinks or name not in means:
                self.warnings.append(f"cnn: {name}: recovery='bias' needs a consumer bias or a BatchNorm after it; "
                                     "its inputs are cut only")
                continue
            fold_means(modules[name], sorted(positions), means[name], sinks.get(name))

    @staticmethod
    def _run_order(model: nn.Module, names: list[str], x) -> list[str]:
        """``names`` in the order the model calls them on input ``x``."""
        modules, seen = dict(model.named_modules()), []
        handles = [modules[n].register_forward_pre_hook(lambda mod, args, n=n: seen.append(n)) for n in names]
        try:
            with _evaluating(model):
                call_model(model, x)
        finally:
            for h in handles:
                h.remove()
        return list(dict.fromkeys(seen)) + [n for n in names if n not in seen]



def _out_keep(model: nn.Module, chosen: list[PruneGroup], names: list[str]) -> dict[str, torch.Tensor]:
    """The original output rows each of ``names`` keeps (only those that lost some)."""
    modules = dict(model.named_modules())
    cut: dict[str, set[int]] = {}
    for g in chosen:
        for m in [*g.producers, *g.passive]:
            if m.name in names:
                cut.setdefault(m.name, set()).update(m.positions(g.removed))
    out = {}
    for name, rows in cut.items():
        m = modules[name]
        total = m.weight.shape[0] + len(rows)  # apply_removal has already cut them
        out[name] = torch.tensor([i for i in range(total) if i not in rows], dtype=torch.long)
    return out


def cnn_domain(upstream_rules: bool = False) -> CnnDomain:
    """A fresh CNN domain (the table of domains builds one per search)."""
    return CnnDomain(upstream_rules=upstream_rules)
