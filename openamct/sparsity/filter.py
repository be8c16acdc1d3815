"""Balanced L2-norm filter pruning: score channels, choose the kept count, remove channels.

Removal works on the module tree of the (already deep-copied) model. All groups are applied
at once: removals are first gathered per (module, axis) in the original coordinates, then
every tensor is sliced once, so a concat consumer's offsets never shift under us.

Device: scores and new tensors are computed on the device of the weights they come from
(``take`` builds its index tensor there); only the per-group scores come to the CPU, once,
to choose the channels. Tensors are sliced with ``narrow`` / ``index_select``, not Python
indexing, so the same code runs on the meta device and under ``FakeTensorMode``.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from openamct.layer_types import BATCHNORM_TYPES, CONVS, TRANSPOSED_CONVS, features, layer_type_of
from openamct.sparsity.channel_params import ATTRIBUTE, PARAMETER, owner_size, sliced, vector_dim
from openamct.sparsity.group import PruneGroup
from openamct.sparsity.head_bias import embedding_columns

logger = logging.getLogger(__name__)



def channel_scores(weight: torch.Tensor) -> torch.Tensor:
    """‖W_c‖₂ / (numel/Cout) per output channel (axis 0), min-max normalised to 0..1."""
    w = weight.detach().to(torch.float64)
    cout = w.shape[0]
    s = w.reshape(cout, -1).norm(dim=1) / (w.numel() / cout)
    lo, span = s.min(), s.max() - s.min()
    # all equal: no preference (chosen on the device: a Python branch would read span back)
    return torch.where(span > 0, (s - lo) / span, torch.zeros_like(s))


def take(t: torch.Tensor, dim: int, index: list[int]) -> torch.Tensor:
    """``t``'s entries ``index`` along ``dim``; the index tensor is made on ``t``'s device
    (``index_select`` refuses a CPU index for a CUDA tensor)."""
    return t.index_select(dim, torch.tensor(index, dtype=torch.long, device=t.device))


def kept_count(n: int, ratio: float, ascend_optimized: bool, prune_group: int = 1, align: int = 16) -> int:
    """C − round(C·r), rounded up to a multiple of ``align`` (ascend_optimized: 16 channels, or
    the units that make 16 rows: 1 head of 64) and of prune_group; at least one channel per
    block. A result >= n means: leave the layer as it is."""
    remain = n - round(n * ratio)
    multiple = math.lcm(align, prune_group) if ascend_optimized else prune_group
    remain = math.ceil(remain / multiple) * multiple
    return min(max(remain, prune_group), n)


def select_removed(scores: torch.Tensor, remain: int, prune_group: int) -> list[int]:
    """Lowest scores go, the same number in each of ``prune_group`` contiguous blocks;
    ties remove the lower index first."""
    n = scores.numel()
    blk, drop = n // prune_group, (n - remain) // prune_group
    removed: list[int] = []
    for b in range(prune_group):
        order = torch.argsort(scores[b * blk:(b + 1) * blk], stable=True)
        removed.extend(b * blk + int(i) for i in order[:drop])
    return sorted(removed)


def group_scores(modules: dict[str, nn.Module], g: PruneGroup) -> torch.Tensor:
    """The summed channel scores of a group's producers (float64, on their weights' device)."""
    total = None
    for p in g.producers:
        if p.name not in modules:
            raise ValueError(f"filter prune: layer {p.name!r} does not exist in the model")
        m = modules[p.name]
        w = m.weight.detach()
        w = w.t() if layer_type_of(m).name == "Conv1D" else w  # output channels first
        if p.end > w.shape[0] or p.end - p.begin != g.channels * p.repeat:
            raise ValueError(f"filter prune: layer {p.name!r} has {w.shape[0]} output channels, "
                             f"its group expects {g.channels * p.repeat} at {p.begin}..{p.end - 1}")
        w = w.narrow(0, p.begin, p.end - p.begin)  # one piece of a fused projection (GPT-2's c_attn: Q, K or V)
        # a unit of p.repeat rows (an attention head) is scored as one filter
        s = channel_scores(w.reshape(g.channels, -1))
        total = s if total is None else total + s.to(total.device)  # every producer counts, not just the first
    return total


def score_and_select(model: nn.Module, groups: list[PruneGroup]) -> None:
    """Fill ``group.removed`` for every group (an empty list when the layer is too small)."""
    modules = dict(model.named_modules())
    for g in groups:
        total = group_scores(modules, g).cpu()  # one read per group: the choice is made on the CPU
        # ascend_optimized aligns the kept rows of every producer: a unit of r rows (a head)
        # needs 16 / gcd(16, r) units per step, not 16
        align = math.lcm(*(16 // math.gcd(16, p.repeat) for p in g.producers))
        remain = kept_count(g.channels, g.ratio, g.ascend_optimized, g.prune_group, align)
        g.removed = select_removed(total, remain, g.prune_group) if remain < g.channels else []
        if not g.removed:
            logger.info("filter prune: %s left whole (%d channels, ratio %g, %d kept after alignment)",
                        ", ".join(g.producer_names), g.channels, g.ratio, remain)


# -- physical removal ------------------------------------------------------------------------

def _gather(model: nn.Module, groups: list[PruneGroup]) -> dict[str, dict[str, set[int]]]:
    """module (or bare parameter) name -> {"out": positions, "in": positions} in original
    coordinates."""
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    cuts: dict[str, dict[str, set[int]]] = {}
    for g in groups:
        if not g.removed:
            continue
        for m in g.members():
            if m.is_function:
                continue
            if m.op_type == ATTRIBUTE:
                if not isinstance(getattr(modules.get(m.name.rpartition(".")[0]), m.name.rpartition(".")[2],
                                          None), int):
                    raise ValueError(f"filter prune: attribute {m.name!r} does not exist in the model")
            elif m.name not in (params if m.op_type == PARAMETER else modules):
                what = "parameter" if m.op_type == PARAMETER else "layer"
                raise ValueError(f"filter prune: {what} {m.name!r} does not exist in the model")
            if m.op_type == ATTRIBUTE and m.name in cuts and cuts[m.name].get("group") != id(g):
                raise ValueError(f"filter prune: attribute {m.name!r} follows two groups' channels")
            axis = "in" if m.role == "consumer" else "out"
            cuts.setdefault(m.name, {"out": set(), "in": set(), "group": id(g)})[axis].update(m.positions(g.removed))
    return cuts


def _keep(n: int, cut: set[int], what: str) -> list[int]:
    bad = [i for i in cut if not 0 <= i < n]
    if bad:
        raise ValueError(f"filter prune: {what}: position {bad[0]} is outside 0..{n - 1}")
    return [i for i in range(n) if i not in cut]


def _blockwise(n: int, blocks: int, cut: set[int], what: str) -> list[list[int]]:
    """Kept local indices of each of ``blocks`` contiguous blocks; all must keep as many."""
    keep = set(_keep(n, cut, what))
    blk = n // blocks
    kept = [[i - b * blk for i in range(b * blk, (b + 1) * blk) if i in keep] for b in range(blocks)]
    if len({len(k) for k in kept}) > 1:
        raise ValueError(f"filter prune: {what}: groups={blocks} needs the same number of channels removed "
                         f"from each group, got {[blk - len(k) for k in kept]}")
    return kept


Edit = tuple[dict[str, torch.Tensor], dict[str, int]]  # new tensors, new int attributes


def _with_bias(m: nn.Module, weight: torch.Tensor, rows: list[int]) -> dict[str, torch.Tensor]:
    return {"weight": weight} if m.bias is None else {"weight": weight, "bias": take(m.bias.data, 0, rows)}


def _cut_conv(name: str, m: nn.Module, out_cut: set[int], in_cut: set[int]) -> Edit:
    w, g = m.weight.data, m.groups
    if g > 1 and g == m.in_channels and not isinstance(m, TRANSPOSED_CONVS):  # depthwise: follows its input
        if in_cut:
            raise ValueError(f"filter prune: depthwise conv {name!r} only loses whole channels")
        mult = m.out_channels // m.in_channels
        keep = _keep(m.out_channels, out_cut, f"{name}.out_channels")
        if any(c * mult + j not in out_cut for c in {p // mult for p in out_cut} for j in range(mult)):
            raise ValueError(f"filter prune: depthwise conv {name!r} must lose all {mult} outputs of a channel")
        n = len(keep) // mult  # upstream left out_channels stale here; all four must agree
        return _with_bias(m, take(w, 0, keep), keep), {"out_channels": len(keep), "in_channels": n, "groups": n}
    if isinstance(m, TRANSPOSED_CONVS):  # weight (Cin, Cout/g, ...): input channels are rows
        if out_cut:
            raise ValueError(f"filter prune: {name!r} ({type(m).__name__}) is only pruned on its input channels")
        cin_g = m.in_channels // g
        keep = [b * cin_g + i for b, k in enumerate(_blockwise(m.in_channels, g, in_cut, name)) for i in k]
        return {"weight": take(w, 0, keep)}, {"in_channels": len(keep)}
    cout_g = m.out_channels // g
    rows = _blockwise(m.out_channels, g, out_cut, f"{name}.out_channels")
    cols = _blockwise(m.in_channels, g, in_cut, f"{name}.in_channels")
    # a grouped conv's input channel i of group b sits in column i - b*Cin/g of rows of group b only
    weight = torch.cat([take(take(w.narrow(0, b * cout_g, cout_g), 0, rows[b]), 1, cols[b]) for b in range(g)], 0)
    keep_rows = [b * cout_g + i for b in range(g) for i in rows[b]]
    return _with_bias(m, weight, keep_rows), {"out_channels": len(keep_rows), "in_channels": sum(map(len, cols))}


def _edit(name: str, m: nn.Module, out_cut: set[int], in_cut: set[int]) -> Edit:
    """The new tensors and sizes of one module; nothing is changed yet."""
    if isinstance(m, CONVS + TRANSPOSED_CONVS):
        return _cut_conv(name, m, out_cut, in_cut)
    if isinstance(m, nn.Linear):
        rows = _keep(m.out_features, out_cut, f"{name}.out_features")
        cols = _keep(m.in_features, in_cut, f"{name}.in_features")
        tensors = {"weight": take(take(m.weight.data, 0, rows), 1, cols)}
        if m.bias is not None:
            tensors["bias"] = take(m.bias.data, 0, rows)
        return tensors, {"out_features": len(rows), "in_features": len(cols)}
    row = layer_type_of(m)
    if row is not None and row.name == "Conv1D":  # weight [in, out]; the forward reads nf
        n_in, n_out = features(m)
        outs, ins = _keep(n_out, out_cut, f"{name}.nf"), _keep(n_in, in_cut, f"{name}.nx")
        tensors = {"weight": take(take(m.weight.data, 0, ins), 1, outs)}
        if m.bias is not None:
            tensors["bias"] = take(m.bias.data, 0, outs)
        return tensors, {"nf": len(outs)} | ({"nx": len(ins)} if hasattr(m, "nx") else {})
    if isinstance(m, nn.Embedding):  # a per-head bias table (T5's relative_attention_bias): columns
        return embedding_columns(m, _keep(m.embedding_dim, out_cut | in_cut, f"{name}.embedding_dim"))
    if isinstance(m, nn.GroupNorm) and m.num_groups not in (1, m.num_channels):
        kept = _blockwise(m.num_channels, m.num_groups, out_cut | in_cut, f"{name}.num_channels")
        return sliced(m, [b * (m.num_channels // m.num_groups) + i for b, k in enumerate(kept) for i in k])
    if not isinstance(m, BATCHNORM_TYPES) and (n := owner_size(m)) is not None:  # norms, GRN, LayerScale
        return sliced(m, _keep(n, out_cut | in_cut, f"{name} (per-channel parameters)"))
    if isinstance(m, BATCHNORM_TYPES):
        keep = _keep(m.num_features, out_cut | in_cut, f"{name}.num_features")
        tensors = {a: take(getattr(m, a).data, 0, keep) for a in ("weight", "bias", "running_mean", "running_var")
                   if getattr(m, a, None) is not None}
        return tensors, {"num_features": len(keep)}
    raise ValueError(f"filter prune: cannot remove channels of layer {name!r} ({type(m).__name__})")


def _commit(m: nn.Module, edit: Edit) -> None:
    tensors, ints = edit
    for attr, value in tensors.items():
        old = getattr(m, attr)
        if isinstance(old, nn.Parameter):
            setattr(m, attr, nn.Parameter(value.contiguous().clone(), requires_grad=old.requires_grad))
        else:
            m._buffers[attr] = value.contiguous().clone()
    for attr, value in ints.items():
        setattr(m, attr, value)


def _param_edit(model: nn.Module, name: str, cut: set[int]) -> tuple[nn.Module, Edit]:
    """A bare per-channel parameter (LayerScale's gamma): sliced on its one long dim."""
    owner_name, _, attr = name.rpartition(".")
    p = model.get_parameter(name)
    if owner_size(p) is None:
        raise ValueError(f"filter prune: parameter {name!r} {tuple(p.shape)} is not a per-channel vector")
    keep = _keep(p.shape[vector_dim(p)], cut, name)
    return model.get_submodule(owner_name), ({attr: take(p.data, vector_dim(p), keep)}, {})


def _attr_edit(model: nn.Module, name: str, cut: set[int]) -> tuple[nn.Module, Edit]:
    """A size the forward reshapes with (``all_head_size``): the kept count."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    return owner, ({}, {attr: len(_keep(getattr(owner, attr), cut, name))})


def _edits(model: nn.Module, groups: list[PruneGroup]) -> list[tuple[nn.Module, Edit]]:
    modules = dict(model.named_modules())
    kinds = {m.name: m.op_type for g in groups for m in g.passive if m.op_type in (PARAMETER, ATTRIBUTE)}
    special = {PARAMETER: _param_edit, ATTRIBUTE: _attr_edit}
    with torch.no_grad():
        return [special[kinds[name]](model, name, cut["out"]) if name in kinds
                else (modules[name], _edit(name, modules[name], cut["out"], cut["in"]))
                for name, cut in _gather(model, groups).items() if cut["out"] or cut["in"]]


def validate_removal(model: nn.Module, groups: list[PruneGroup]) -> None:
    """Raise the ValueError ``apply_removal`` would raise, changing nothing."""
    _edits(model, groups)


def removal_edits(model: nn.Module, groups: list[PruneGroup]) -> list[tuple[nn.Module, Edit]]:
    """(module, (tensors, sizes)) that removing ``groups`` would set, computed and checked."""
    return _edits(model, groups)


def apply_removal(model: nn.Module, groups: list[PruneGroup], quiet: bool = False) -> None:
    """Physically remove every group's ``removed`` channels from ``model`` (in place). Every
    edit is computed and checked first, so a bad group leaves the model untouched."""
    edits = _edits(model, groups)
    with torch.no_grad():
        for module, edit in edits:
            _commit(module, edit)
    if quiet:
        return
    logger.info("filter prune: removed channels from %d groups (%d layers edited)",
                sum(1 for g in groups if g.removed), len(edits))
