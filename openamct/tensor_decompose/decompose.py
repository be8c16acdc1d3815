"""upstream AMCT's ``auto_decomposition`` and ``decompose_network``.

As upstream's, both change the model in place and return it (upstream's documented exception:
a model that is itself a Conv2d is left as it is and the decomposed pair is returned). Every
decomposition is computed, and every info-file entry checked, before the first module is
replaced, so an error leaves the model as it was.
"""

from __future__ import annotations

import logging

from torch import nn

from openamct._checks import check_model, check_type
from openamct.module_tree import set_module
from openamct.output_paths import check_output, check_path_syntax, folder_for
from openamct.progress import Progress
from openamct.tensor_decompose.factor import build_pair, decompose_conv, mode_of
from openamct.tensor_decompose.info_file import check_entry, entry, read_info, write_info
from openamct.tensor_decompose.rank import ineligible_reason

logger = logging.getLogger(__name__)

__all__ = ["auto_decomposition", "decompose_network"]


def _convs(model: nn.Module) -> dict[int, tuple[nn.Module, list[str]]]:
    """Every Conv2d (subclasses too, to say why they are skipped), once per module object,
    with all the names it is reachable under (a module registered twice is replaced twice)."""
    found: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, nn.Conv2d):
            found.setdefault(id(m), (m, []))[1].append(name)
    return found


def _place(work: nn.Module, names: list[str], seq: nn.Module, changes: dict) -> nn.Module:
    for name in names:
        if name == "":
            work = seq  # the model is the conv itself: the result is the pair
        else:
            set_module(work, name, seq)
        changes[name] = [f"{name}.0", f"{name}.1"] if name else ["0", "1"]
    return work


def _log_skipped(api: str, skipped: list[tuple[str, str]]) -> None:
    """One INFO line per reason (the reasons are fixed phrases), naming a few of its layers;
    each layer at DEBUG."""
    kinds: dict[str, list[str]] = {}
    for name, reason in skipped:
        logger.debug("%s: %r not decomposed: %s", api, name, reason)
        kinds.setdefault(reason, []).append(name)
    for kind, names in kinds.items():
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        logger.info("%s: %d Conv2d layer(s) left as they are: %s [%s]", api, len(names), kind, shown)


def auto_decomposition(model, decompose_info_path=None):
    """Split each eligible ``torch.nn.Conv2d`` of ``model`` into two convs (K_h x 1 and 1 x K_w)
    by a truncated SVD at upstream AMCT's rank; returns ``(decomposed_model, changes)``.

    ``changes`` maps each decomposed conv's name to its two new layers' names, e.g.
    ``{'layer4.0': ['layer4.0.0', 'layer4.0.1']}``. ``decompose_info_path`` (optional): where
    to write the decomposition info JSON that ``decompose_network`` reads (upstream's format,
    versioned; written atomically). ``model`` is changed in place and returned, as upstream
    does (a model that is itself a Conv2d is not: the pair is returned). Any floating dtype;
    the factors are computed in float64 and cast back. Fine-tune the result before use:
    decomposition is lossy.
    """
    model = check_model(model, float32_only=False)
    check_type("decompose_info_path", decompose_info_path, str, allow_none=True)
    if decompose_info_path is not None:
        decompose_info_path = check_output("decompose_info_path", decompose_info_path, "decompose_info",
                                           make_folder=True)
    work = model
    changes: dict[str, list[str]] = {}
    entries, errors, pairs = [], [], []
    before = after = 0
    convs = list(_convs(work).values())
    eligible = [(conv, names) for conv, names in convs if ineligible_reason(conv) is None]
    skipped = [(n, ineligible_reason(conv)) for conv, names in convs if ineligible_reason(conv) is not None
               for n in names]
    with Progress("auto_decomposition", total=len(eligible), logger=logger, unit="conv") as progress:
        for conv, names in eligible:
            seq, err = decompose_conv(conv)
            progress.update(what=names[0])
            before += conv.weight.numel()
            after += seq[0].weight.numel() + seq[1].weight.numel()
            errors.append((err, names[0]))
            logger.debug("auto_decomposition: %r -> rank %d (%s), relative weight error %.4f", names[0],
                         seq[0].out_channels, mode_of(conv), err)
            entries += [entry(n, conv, mode_of(conv), seq[0].weight.shape, seq[1].weight.shape) for n in names]
            pairs.append((names, seq))
    _log_skipped("auto_decomposition", skipped)
    if errors:
        worst = max(errors)
        logger.info("auto_decomposition: %d Conv2d layer(s) decomposed, their weights %d -> %d values; "
                    "largest relative weight error %.3f (%r): fine-tune before use", len(errors), before, after,
                    worst[0], worst[1])
    else:
        logger.info("auto_decomposition: no Conv2d layer meets the decomposition conditions")
    if decompose_info_path is not None:
        with folder_for(decompose_info_path):
            write_info(decompose_info_path, entries)
        logger.info("auto_decomposition: decomposition info written to %s", decompose_info_path)
    for names, seq in pairs:  # the model changes only once everything above has succeeded
        work = _place(work, names, seq, changes)
    return work, changes


def decompose_network(model, decompose_info_path):
    """Give a copy of ``model`` the structure that ``decompose_info_path`` (written by
    ``auto_decomposition``, openamct's or upstream's) describes; returns ``(model, changes)``.

    Only the structure changes: the new convs hold default-initialised weights, so load the
    decomposed model's state dict afterwards. Every entry is checked against ``model`` (layer
    names, channels, kernel, stride, padding, ranks) before anything is built; a mismatch is a
    ValueError naming the layer. ``model`` is changed in place and returned, as upstream does
    (a model that is itself a Conv2d is not: the pair is returned).
    """
    model = check_model(model, float32_only=False)
    check_type("decompose_info_path", decompose_info_path, str)
    path = check_path_syntax("decompose_info_path", decompose_info_path)
    entries = read_info(path)
    modules = dict(model.named_modules(remove_duplicate=False))
    plan = []
    for e in entries:
        name = e["ori_layer_info"]["name"]
        if name not in modules:
            raise ValueError(f"decompose_info_path {decompose_info_path!r}: layer {name!r} is not in the model: "
                             "the file describes another model")
        plan.append((name, e["mode"], check_entry(e, modules[name], decompose_info_path)))
    work = model
    built: dict[int, nn.Module] = {}  # one pair per conv object, shared by its aliases
    placed = []
    for name, mode, rank in plan:
        conv = modules[name]
        seq = built.get(id(conv))
        if seq is None:
            seq = built[id(conv)] = build_pair(conv, mode, rank)
        placed.append((name, seq))
    changes: dict[str, list[str]] = {}
    for name, seq in placed:  # the model changes only once every pair is built
        work = _place(work, [name], seq, changes)
    logger.info("decompose_network: %d Conv2d layer(s) given the decomposed structure; load the decomposed "
                "weights next", len(changes))
    return work, changes
