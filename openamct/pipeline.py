"""config + model -> captured graph -> per-layer plan -> techniques applied -> record written.

restore replays the record instead of re-deciding; save folds everything and writes ONNX.
Every technique goes through the same verbs (``openamct.techniques.base``), in the order their
``after`` declarations give (``openamct.techniques.order``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from openamct.checkpoint import load_into
from openamct.compressed.attention import split_cross_attention, substitute_attention
from openamct.compressed.functional import attach_routes
from openamct.compressed.layer import CompressedLayer
from openamct.compressed.recurrent import RecurrentLayer
from openamct.compressed.wrap import is_wrapped, wrap_layer
from openamct.config.source import load_plan
from openamct.config.specs import Plan
from openamct.export.fp32_reference import unfused_attention
from openamct.graph.capture import capture_graph
from openamct.graph.graph import Graph
from openamct.graph.layers import LayerInfo, find_layers
from openamct.graph.parametrized import evaluate_parametrizations
from openamct.module_tree import set_module
from openamct.output_paths import folder_for, probe_folder
from openamct.progress import Progress
from openamct.record.file_io import read_record
from openamct.record.fingerprint import check_fingerprint, fingerprint_header
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.techniques import TECHNIQUES, Context, Technique, ordered
from openamct.training import decisions
from openamct.training.keeper import RecordKeeper
from openamct.training.placement import place_added_modules

logger = logging.getLogger(__name__)

# Parameters from which a model whose tensors are all on the CPU takes the large-model machinery
# (``openamct/large/``) when ``large_model`` is left unset; docs/large-models.md says what it
# buys on either side.
LARGE_MODEL_PARAMS = 200_000_000


def takes_large_path(model: nn.Module, large_model: bool | None) -> bool:
    """The large-model switch: ``large_model`` True or False, or None for the default (every
    tensor on the CPU and at least ``LARGE_MODEL_PARAMS`` parameters). Its pieces are CPU-only:
    True for a model with a tensor elsewhere is a ValueError."""
    if large_model is not None and not isinstance(large_model, bool):
        raise TypeError(f"large_model: expected a bool or None, got {type(large_model).__name__}")
    if large_model is False:
        return False
    devices = {t.device.type for t in (*model.parameters(), *model.buffers())}
    on_cpu = devices == {"cpu"}
    if large_model:
        if not on_cpu:
            raise ValueError(f"large_model=True: the large-model machinery runs on the CPU only, and the model has "
                             f"tensors on {sorted(devices - {'cpu'}) or 'no device'}; leave large_model unset")
        return True
    return on_cpu and sum(p.numel() for p in model.parameters()) >= LARGE_MODEL_PARAMS


def _record_text(large: bool):
    """The record's fast printer and parser (``record.file_io.FastText``) on the large path."""
    if not large:
        return None
    from openamct.large.attach import RECORD_TEXT

    return RECORD_TEXT


def is_compressed(model: nn.Module) -> bool:
    return hasattr(model, "_openamct") or any(is_wrapped(m) for m in model.modules())


@dataclass
class Analysis:
    graph: Graph
    layers: dict[str, LayerInfo]
    plan: Plan
    techniques: tuple[Technique, ...] = TECHNIQUES  # the registry whose config slices made the plan


def analyse(model: nn.Module, input_data: Any, config: str | None, api: str,
            config_arg: str = "config_defination", techniques: Sequence[Technique] = TECHNIQUES) -> Analysis:
    """Capture + plan on ``model`` itself (callers pass a copy: it is edited even when they
    will not edit it, since nn.MultiheadAttention is replaced by an openamct module whose
    projections are layers, compressed/attention.py, before the capture)."""
    techniques = ordered(techniques)
    evaluate_parametrizations(model)
    substitute_attention(model)
    graph = capture_graph(model, input_data)
    if split_cross_attention(model, graph):  # the cross-attention layout changes the module tree
        graph = capture_graph(model, input_data)
    layers = find_layers(model, graph)
    modules = {n: type(m).__name__ for n, m in model.named_modules()}
    plan = load_plan(config, layers, api, modules, config_arg, techniques=techniques)
    return Analysis(graph, layers, plan, techniques)


def _build(model: nn.Module, input_data: Any, config: str, record_file: str, api: str, restoring: bool,
           config_arg: str, techniques: Sequence[Technique], large_model: bool | None) -> nn.Module:
    if is_compressed(model):
        raise ValueError("model already contains openamct modules: pass the original (uncompressed) model; "
                         "to resume training use restore_* with the original model")
    techniques = ordered(techniques)  # before any work: a cycle or unknown name is refused here
    large = takes_large_path(model, large_model)
    if restoring:
        record = read_record(record_file, _record_text(large))
        _check_owned(record, techniques)
    else:
        probe_folder("record_file", record_file, make_folder=True)  # made when the record is written
        record = ScaleOffsetRecord()
    from openamct.export.precheck import check_modules

    check_modules(model, "create")
    progress = Progress("restore" if restoring else "create", total=len(techniques) + 2, logger=logger)
    try:
        return _build_steps(model, input_data, config, record_file, api, restoring, config_arg, techniques, large,
                            record, progress)
    finally:
        progress.close()


def _build_steps(model, input_data, config, record_file, api, restoring, config_arg, techniques, large, record,
                 progress: Progress) -> nn.Module:
    work = deep_copy(model)
    a = analyse(work, input_data, config, api, config_arg, techniques)
    progress.update(what="graph captured, config planned")
    header = fingerprint_header(a.layers)  # of the original model: before any technique edits it
    if restoring:
        with open(record_file, encoding="utf-8") as f:
            check_fingerprint(f.read(), a.layers, f"record_file {record_file!r}")
    ctx = Context(work, a.graph, a.layers, a.plan, record, restoring, record_file if restoring else None,
                  input_data=input_data)
    applied = []
    for technique in techniques:
        progress.update(what=technique.name)
        if not technique.wanted(ctx):
            continue
        if restoring:
            try:
                state = technique.from_record(ctx)
                technique.check_restore(ctx, state)
            except ValueError as exc:  # name the file: the techniques say only "record_file"
                msg = str(exc).removeprefix("record_file").lstrip(": ")
                raise ValueError(f"record_file {record_file!r}: {msg}") from None
        else:
            state = technique.plan(ctx)
        technique.apply(ctx, state)
        applied.append((technique, state))
        logger.info("%s: %s applied", "restore" if restoring else "create", technique.name)
    layers = {}
    for name, parts in ctx.parts.items():
        layers[name] = wrap_layer(work.get_submodule(name), parts)
        if parts.act_quant is not None and not getattr(parts.act_quant, "layer_name", "x"):
            parts.act_quant.layer_name = name
        set_module(work, name, layers[name])
    progress.update(what="layers wrapped")
    place_added_modules(work, layers)
    _route_functional(work, a.layers, layers)
    keeper = RecordKeeper(record_file, applied, layers)
    keeper.header = header
    keeper.attach(work)
    keeper.decisions = decisions.of_model(applied, layers)
    decisions.attach(work, keeper.decisions)
    if large:  # branch point: the large-model hooks (openamct/large/__init__.py)
        from openamct.large.attach import at_build

        at_build(work, keeper, layers)
    return work


def _route_functional(work: nn.Module, found: dict[str, LayerInfo], wrapped: dict[str, nn.Module]) -> None:
    """Hook the owners of wrapped Linears computed by an ``F.linear`` call in the owner's code
    (``LayerInfo.functional``) so that call runs the compressed layer (compressed/functional.py)."""
    routes: dict[str, list[tuple[int, str]]] = {}
    for name in wrapped:
        info = found.get(name)
        if info is not None and info.functional is not None:
            owner, position = info.functional
            routes.setdefault(owner, []).append((position, name[len(owner) + 1:] if owner else name))
    for owner, pairs in routes.items():
        attach_routes(work.get_submodule(owner), pairs)


def deep_copy(model: nn.Module) -> nn.Module:
    """The working copy (the caller's model is never edited); a model that cannot be copied is
    a ValueError saying what to change."""
    try:
        return copy.deepcopy(model)
    except Exception as exc:  # whatever an attribute's __deepcopy__/__reduce__ raises
        raise ValueError(f"model cannot be deep-copied ({type(exc).__name__}: {exc}); openamct works on a copy so "
                         "that your model stays as it is: keep locks, open files, sockets and similar objects "
                         "off the module (or give them a __deepcopy__)") from None


def _check_owned(record: ScaleOffsetRecord, techniques: Sequence[Technique]) -> None:
    for i, entry in enumerate(record.prune_record):
        if not any(t.owns(entry) for t in techniques):
            raise ValueError(f"record_file prune_record[{i}] ({entry.selective_prune.name!r}) belongs to no technique "
                             f"of this openamct ({', '.join(t.name for t in techniques)}): written by another tool?")


def create(model: nn.Module, input_data: Any, config: str, record_file: str, api: str,
           config_arg: str = "config_defination", techniques: Sequence[Technique] = TECHNIQUES,
           large_model: bool | None = None) -> nn.Module:
    work = _build(model, input_data, config, record_file, api, False, config_arg, techniques, large_model)
    with folder_for(record_file):
        work._openamct.flush()
    return work


def restore(model: nn.Module, input_data: Any, config: str, record_file: str, pth_file: str,
            state_dict_name: str | None, api: str, config_arg: str = "config_defination",
            techniques: Sequence[Technique] = TECHNIQUES, replay: bool = True,
            large_model: bool | None = None) -> nn.Module:
    """``replay`` false (the QAT family given a new record path, as upstream's restore takes
    one): the model is built from the config as create builds it, its record written anew."""
    if not os.path.isfile(pth_file):
        raise ValueError(f"pth_file {pth_file!r} does not exist or is not a file")
    if replay:
        work = _build(model, input_data, config, record_file, api, True, config_arg, techniques, large_model)
    else:
        work = create(model, input_data, config, record_file, api, config_arg, techniques, large_model)
    loader = None
    if work._openamct.large_model:
        from openamct.large.attach import part_loader

        loader = part_loader(work)
    load_into(work, pth_file, state_dict_name, loader)
    decisions.check_checkpoint(work, work._openamct.decisions, pth_file)
    try:
        work._openamct.after_checkpoint()
    except ValueError as exc:  # a technique refusing the checkpoint's values
        raise ValueError(f"pth_file {pth_file!r}: {exc}") from None
    if not replay:  # the new record holds the checkpoint's scales from the start
        work._openamct.flush()
    return work


def uninitialised_layers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules()
            if (isinstance(m, CompressedLayer) and m.act_quant is not None and not bool(m.act_quant.initialized))
            or (isinstance(m, RecurrentLayer) and m.quantizers_pending())]


def save(model: nn.Module, save_path: str, input_data: Any, record_file: str | None,
         input_names, output_names, dynamic_axes, placement: str | None = None) -> tuple[str, str]:
    from openamct._checks import save_paths
    from openamct.export.writer import export_pair

    keeper = getattr(model, "_openamct", None)
    if keeper is None:
        raise ValueError("model was not returned by an openamct create_*/restore_* function: save_* needs the "
                         "compressed model (it carries the record and the quantizers)")
    fake_path, deploy_path = save_paths(save_path)
    if placement is not None and keeper.large_model:
        raise ValueError(f"placement={placement!r} is not available on the large-model path (large_model): "
                         "save without it, or create the model with large_model=False")
    keeper.undo_failed_forward()
    from openamct.export.precheck import check_modules, check_names

    check_modules(model, "save")
    check_names(model, input_data, input_names, output_names, dynamic_axes)
    pending = uninitialised_layers(model)
    if pending:
        raise ValueError(
            f"the activation quantizers of {len(pending)} layer(s) ({', '.join(pending[:4])}{' ...' if len(pending) > 4 else ''}) "
            "are not initialised yet: run the compressed model on real data first (clips are initialised from the "
            "first batch_num forward passes), e.g. model.eval(); model(x) with a real batch, then call save_* again")
    decisions.check_record_file(model, keeper.techniques, record_file or keeper.path)
    try:
        with folder_for(record_file or keeper.path):
            keeper.flush(record_file)
    except OSError as exc:
        raise ValueError(f"record_file {record_file or keeper.path!r} cannot be written: {exc}") from None
    from openamct.export.precheck import explain_export_error

    made = _make_folders(os.path.dirname(os.path.abspath(fake_path)))
    try:
        # an nn.MultiheadAttention left as it is (compressed/attention.py): its fused no-grad path
        # (aten::_native_multi_head_attention) has no ONNX export; the unfused path computes the
        # same function.
        streamed = None
        if keeper.large_model:  # branch point: the large path saves a weight at a time
            from openamct.large.attach import streamed_save

            streamed = streamed_save(model)
        with unfused_attention():
            export_pair(model, fake_path, deploy_path, input_data, input_names, output_names, dynamic_axes,
                        techniques=keeper.techniques, streamed_save=streamed, placement=placement)
    except torch.onnx.OnnxExporterError as exc:
        _remove_empty(made)
        raise explain_export_error(model, exc) from None
    except BaseException:
        _remove_empty(made)
        raise
    return fake_path, deploy_path


def _make_folders(folder: str) -> list[str]:
    """Create ``folder`` and its missing parents; the ones created, deepest first."""
    made = []
    while not os.path.isdir(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    for path in reversed(made):
        os.mkdir(path)
    return made


def _remove_empty(folders: list[str]) -> None:
    """A failed save leaves no folder it made (deepest first, only while empty)."""
    for path in folders:
        with contextlib.suppress(OSError):
            os.rmdir(path)
