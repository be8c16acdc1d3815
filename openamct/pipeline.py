"""config + model -> captured graph -> per-layer plan -> techniques -> record written.

restore replays the record instead of re-deciding; save folds everything and writes ONNX.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from openamct.checkpoint import load_into
from openamct.config.plan import build_plan
from openamct.config.quant_json import load_plan_source
from openamct.config.specs import Plan
from openamct.graph.capture import capture_graph
from openamct.graph.graph import Graph
from openamct.graph.layers import LayerInfo, find_layers
from openamct.record.io import read_record
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.session import RecordKeeper
from openamct.techniques import TECHNIQUES, Context, wrap_layers

logger = logging.getLogger(__name__)


def is_compressed(model: nn.Module) -> bool:
    from openamct.quant.layer import CompressedLayer

    return hasattr(model, "_openamct") or any(isinstance(m, CompressedLayer) for m in model.modules())


@dataclass
class Analysis:
    model: nn.Module
    graph: Graph
    layers: dict[str, LayerInfo]
    plan: Plan


def analyse(model: nn.Module, input_data: Any, config: str, api: str, config_arg: str = "config_defination") -> Analysis:
    """Capture + plan on ``model`` itself (callers pass a copy when they will edit it)."""
    graph = capture_graph(model, input_data)
    layers = find_layers(model, graph)
    modules = {n: type(m).__name__ for n, m in model.named_modules()}
    if config is None:  # the QAT family without a config: every supported layer, defaults
        from openamct.config.retrain_config_pb2 import AMCTRetrainConfig

        plan = build_plan(AMCTRetrainConfig(), layers, api, modules=modules, src="default config")
    else:
        plan = load_plan_source(config, layers, api, modules, config_arg)
    return Analysis(model, graph, layers, plan)


def _build(model: nn.Module, input_data: Any, config: str, record_file: str, api: str,
           restoring: bool, config_arg: str) -> tuple[nn.Module, Context]:
    if is_compressed(model):
        raise ValueError("model already contains openamct modules: pass the original (uncompressed) model; "
                         "to resume training use restore_* with the original model")
    if restoring:
        record = read_record(record_file)
    else:
        folder = os.path.dirname(os.path.abspath(record_file))
        if not os.path.isdir(folder):
            raise ValueError(f"record_file {record_file!r}: folder {folder!r} does not exist")
        record = ScaleOffsetRecord()
    work = copy.deepcopy(model)
    a = analyse(work, input_data, config, api, config_arg)
    ctx = Context(work, a.graph, a.layers, a.plan, record, restoring)
    for technique in TECHNIQUES:
        if not technique.wanted(ctx):
            continue
        decisions = technique.replay(ctx) if restoring else technique.decide(ctx)
        technique.apply(ctx, decisions)
        if not restoring:
            technique.record(ctx, decisions)
        logger.info("%s: %s applied", "restore" if restoring else "create", technique.name)
    wrapped = wrap_layers(ctx)
    if restoring:
        _check_quant_entries(ctx.record, wrapped)
    keeper = RecordKeeper(record_file, ctx.record, wrapped)
    keeper.attach(work)
    return work, ctx


def _check_quant_entries(record: ScaleOffsetRecord, wrapped: dict[str, nn.Module]) -> None:
    quantized = {n for n, m in wrapped.items() if getattr(m, "act_quant", None) is not None}
    for entry in record.record:
        if entry.key not in quantized:
            raise ValueError(f"record_file has quantization scales for layer {entry.key!r}, which this model and "
                             "config do not quantize (record from another model or config?)")


def create(model: nn.Module, input_data: Any, config: str, record_file: str, api: str,
           config_arg: str = "config_defination") -> nn.Module:
    work, _ = _build(model, input_data, config, record_file, api, False, config_arg)
    work._openamct.flush()
    return work


def restore(model: nn.Module, input_data: Any, config: str, record_file: str, pth_file: str,
            state_dict_name: str | None, api: str, config_arg: str = "config_defination") -> nn.Module:
    if not os.path.isfile(pth_file):
        raise ValueError(f"pth_file {pth_file!r} does not exist or is not a file")
    work, _ = _build(model, input_data, config, record_file, api, True, config_arg)
    recorded = work._openamct.ready_masks()  # installed from the record
    load_into(work, pth_file, state_dict_name)
    _compare_masks(work, recorded)
    return work


def _compare_masks(work: nn.Module, recorded: dict[str, torch.Tensor]) -> None:
    """Restore installs the record's 2:4 masks, then the checkpoint's own copies (buffers) load over
    them. Both agree unless masks changed between the checkpoint and the last record write
    (update_freq > 0): then the checkpoint's masks are kept, because they are the ones its
    weights and step counter were trained with (an exact resume), and the user is told. The
    record is not rewritten here: an evaluation script must not touch a live job's record; the
    resumed job rewrites it at its next mask change or eval forward after training."""
    keeper = work._openamct
    differ = keeper.masks_differing_from(recorded)
    if differ:
        logger.warning("pth_file: the 2:4 masks of %d layer(s) (%s) differ from record_file's (the record was "
                       "rewritten after this checkpoint, update_freq > 0); using the checkpoint's, which belong to "
                       "its weights", len(differ), ", ".join(differ[:4]) + (" ..." if len(differ) > 4 else ""))
    keeper.mark_masks_recorded()


def uninitialised_layers(model: nn.Module) -> list[str]:
    from openamct.quant.layer import CompressedLayer

    return [n for n, m in model.named_modules()
            if isinstance(m, CompressedLayer) and m.act_quant is not None and not bool(m.act_quant.initialized)]


def save(model: nn.Module, save_path: str, input_data: Any, record_file: str | None,
         input_names, output_names, dynamic_axes) -> tuple[str, str]:
    from openamct._checks import save_paths

    keeper = getattr(model, "_openamct", None)
    if keeper is None:
        raise ValueError("model was not returned by an openamct create_*/restore_* function: save_* needs the "
                         "compressed model (it carries the record and the quantizers)")
    fake_path, deploy_path = save_paths(save_path)
    pending = uninitialised_layers(model)
    if pending:
        raise ValueError(
            f"the activation quantizers of {len(pending)} layer(s) ({', '.join(pending[:4])}{' ...' if len(pending) > 4 else ''}) "
            "are not initialised yet: run the compressed model on real data first (clips are initialised from the "
            "first batch_num forward passes), e.g. model.eval(); model(x) with a real batch, then call save_* again")
    keeper.flush(record_file)
    from openamct.export.writer import export_pair

    export_pair(model, fake_path, deploy_path, input_data, input_names, output_names, dynamic_axes)
    return fake_path, deploy_path
