"""Upstream AMCT's distillation functions: create_distill_config, create_distill_model, distill,
save_distill_model (signatures as amct_pytorch's). docs/distill.md describes the flows.

``create_distill_model`` quantizes through the retrain pipeline: it writes the equivalent retrain
config beside ``config_file`` (``<stem>_retrain.cfg``) and the record (``<stem>.record``), so a
distilled model restores with ``restore_compressed_retrain_model(model, input_data,
"<stem>_retrain.cfg", "<stem>.record", pth_file)``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from openamct import pipeline
from openamct._atomic import atomic_write_bytes
from openamct._checks import (
    check_dynamic_axes,
    check_input_data,
    check_model,
    check_names,
    check_type,
    save_paths,
    unwrap,
)
from openamct.compressed.layer import CompressedLayer
from openamct.config.errors import ConfigError
from openamct.config.source import build_plan
from openamct.distill.config import (
    INT4_DEPLOYABLE,
    check_int4_types,
    check_skip_types,
    json_to_retrain_text,
    parse_distill_cfg,
    plan_to_json,
    read_distill_json,
    skip_wins,
    to_retrain_config,
    write_json,
)
from openamct.distill.distill_config_pb2 import AMCTDistillConfig
from openamct.distill.distill_sample import DistillSampleBase, model_input
from openamct.distill.groups import check_groups, chunk, find_blocks, unit_blocks
from openamct.distill.train import (
    calibrate,
    merge_pruned_boundaries,
    move_folded_ends,
    reestimate_bn,
    train_groups,
)
from openamct.graph.capture import capture_graph
from openamct.graph.layers import find_layers
from openamct.graph.parametrized import evaluate_parametrizations
from openamct.layer_types import layer_type_of
from openamct.nn.convert import holds_qat_modules, save_qat_model
from openamct.output_paths import check_output, check_path_syntax, folder_for
from openamct.techniques import TECHNIQUES, ordered

logger = logging.getLogger(__name__)

# How the deploy model stores a Linear's INT4 weights (``int4_deploy.FORMATS``): MatMulNBits
# measured faster in ONNX Runtime than opset-21 DequantizeLinear int4 (docs/distill.md).
INT4_DEPLOY_FORMAT = "matmulnbits"

__all__ = ["create_distill_config", "create_distill_model", "distill", "save_distill_model", "derived_paths"]


def derived_paths(config_file: str) -> tuple[str, str]:
    """(retrain config, record) that create_distill_model writes beside ``config_file``."""
    stem = config_file[:-5] if config_file.endswith(".json") else config_file
    return stem + "_retrain.cfg", stem + ".record"


def create_distill_config(config_file, model, input_data, config_defination=None):
    """Write the distillation JSON for ``model`` to ``config_file``: its quantizable layers with
    their settings and its distillation groups, from ``config_defination`` (an AMCTDistillConfig
    .cfg) when given, else every supported layer with INT8 defaults and automatic groups."""
    check_type("config_file", config_file, str)
    model = check_model(model)
    check_input_data(input_data)
    check_type("config_defination", config_defination, str, allow_none=True)
    check_output("config_file", config_file, "quant_json", {"config_defination": config_defination}, make_folder=True)
    cfg, text = parse_distill_cfg(config_defination) if config_defination else (AMCTDistillConfig(), "")
    src = f"config_defination {config_defination!r}" if config_defination else "default config"
    groups = [[g.start_layer_name, g.end_layer_name] for g in cfg.distill_group]
    check_groups(groups, model, model, src)
    work = pipeline.deep_copy(model)
    evaluate_parametrizations(work)
    graph = capture_graph(work, input_data)
    layers = find_layers(work, graph)
    modules = {n: type(m).__name__ for n, m in work.named_modules()}
    check_skip_types(cfg, layers, text, src)
    plan = build_plan(to_retrain_config(cfg), layers, "compressed", techniques=ordered(TECHNIQUES), modules=modules,
                      text=text, src=src)
    skip_wins(plan, cfg)
    check_int4_types(plan, src)
    if not groups:
        groups = chunk(unit_blocks(find_blocks(model), work, graph), cfg.group_size)
    with folder_for(config_file):
        write_json(config_file, plan_to_json(plan, cfg, groups))
    logger.info("create_distill_config: %d layer(s), %d group(s) -> %s", len(plan.quantized()), len(groups),
                config_file)


def _read_json(config_file: str, model: nn.Module):
    dj = read_distill_json(config_file)
    src = f"config_file {config_file!r}"
    modules = dict(model.named_modules())
    for name, entry in dj.layers.items():
        if name not in modules:
            raise ConfigError(f"{src}: layer {name!r} is not a module of the model")
        row = layer_type_of(modules[name])
        w = entry.get("distill_weight_config") or {}
        if entry.get("quant_enable", True) and w.get("dst_type") == "INT4" and (row is None or row.name not in
                                                                               INT4_DEPLOYABLE):
            raise ConfigError(f"{src}: layer {name!r} ({row.name if row else type(modules[name]).__name__}): "
                              f"dst_type INT4 cannot be deployed as 4-bit weights on this layer type (INT4 deploys "
                              f"on {', '.join(INT4_DEPLOYABLE)})")
    return dj, src


def create_distill_model(config_file, model, input_data):
    """A quantized copy of ``model`` as ``config_file`` (create_distill_config's JSON) says, ready
    for ``distill``. Writes ``<stem>_retrain.cfg`` and the record ``<stem>.record`` beside
    ``config_file`` (``derived_paths``)."""
    check_type("config_file", config_file, str)
    model = check_model(model)
    check_input_data(input_data)
    dj, src = _read_json(config_file, model)
    check_groups(dj.groups, model, model, src)
    cfg_path, record = derived_paths(config_file)
    check_path_syntax("config_file", cfg_path)
    check_output("config_file", record, "record", {"config_file": config_file})
    atomic_write_bytes(cfg_path, json_to_retrain_text(dj, src).encode("utf-8"))
    return pipeline.create(model, input_data, cfg_path, record, "compressed")


def check_derived(teacher: nn.Module, student: nn.Module) -> None:
    """``student`` was made by openamct from ``teacher``'s architecture (ValueError otherwise)."""
    if pipeline.is_compressed(teacher):
        raise ValueError("model is a compressed model: pass the original float model (the teacher) as model and "
                         "the compressed one as compress_model")
    if getattr(student, "_openamct", None) is None and not holds_qat_modules(student):
        raise ValueError("compress_model was not returned by an openamct create_* function (create_distill_model, "
                         "create_compressed_retrain_model, create_prune_retrain_model, ...) and holds no "
                         "single-op QAT module (openamct.nn.module.quantization)")
    t_mods = dict(teacher.named_modules())
    for name, m in student.named_modules():
        if not isinstance(m, CompressedLayer):
            continue
        t = t_mods.get(name)
        row, t_row = layer_type_of(m), (layer_type_of(t) if t is not None else None)
        if t is None or t_row is None or row is None or t_row.name != row.name:
            raise ValueError(f"compress_model is not derived from model: its layer {name!r} ({row.name if row else '?'})"
                             f" is {'missing' if t is None else type(t).__name__} in model")
        ws, wt = tuple(m.weight.shape), tuple(t.weight.shape)
        if len(ws) != len(wt) or any(a > b for a, b in zip(ws, wt)):
            raise ValueError(f"compress_model is not derived from model: layer {name!r} has weight {ws} there and "
                             f"{wt} in model")


def _pruned(teacher: nn.Module, student: nn.Module) -> bool:
    """Whether any compressed layer of ``student`` lost channels against ``teacher``."""
    t_mods = dict(teacher.named_modules())
    return any(isinstance(m, CompressedLayer) and tuple(m.weight.shape) != tuple(t_mods[n].weight.shape)
               for n, m in student.named_modules() if n in t_mods)


def _reads_in_order(loader: Any) -> bool:
    """A DataLoader whose sampler walks its dataset in order (``shuffle`` left false)."""
    return isinstance(loader, torch.utils.data.DataLoader) and \
        isinstance(loader.sampler, torch.utils.data.SequentialSampler)


def _check_loader(train_loader: Any) -> Any:
    if train_loader is None or not hasattr(train_loader, "__iter__"):
        raise TypeError(f"train_loader must be an iterable of batches (a DataLoader), got {type(train_loader).__name__}")
    if iter(train_loader) is train_loader:
        raise TypeError("train_loader is a one-pass iterator: give a DataLoader or a list (distill reads it once "
                        "per epoch and once for calibration)")
    if hasattr(train_loader, "__len__") and len(train_loader) == 0:
        raise ValueError("train_loader is empty (length 0): distill needs at least one batch")
    first = next(iter(train_loader), None)
    if first is None:
        raise ValueError("train_loader is empty: distill needs at least one batch")
    return first


def distill(model, compress_model, config_file, train_loader, epochs=1, lr=1e-3, sample_instance=None, loss=None,
            optimizer=None):
    """Train ``compress_model`` group by group to reproduce ``model``'s (the teacher's) outputs on
    ``train_loader``'s inputs (no labels). Returns ``compress_model`` (trained in place, eval mode).

    ``loss(student, teacher)`` per group; default MSE / teacher's mean square. ``optimizer``: used
    as given (it should hold compress_model's parameters); default AdamW(lr) on every trainable
    parameter of compress_model."""
    teacher = check_model(model)
    student = unwrap(compress_model)
    check_type("compress_model", student, nn.Module)
    check_type("config_file", config_file, str)
    if isinstance(epochs, bool) or not isinstance(epochs, int):
        raise TypeError(f"epochs must be int, got {type(epochs).__name__}")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    sample = DistillSampleBase() if sample_instance is None else sample_instance
    if not callable(getattr(sample, "get_model_input_data", None)):
        raise TypeError(f"sample_instance must be a DistillSampleBase (with get_model_input_data), got "
                        f"{type(sample).__name__}")
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be callable (a torch loss module), got {type(loss).__name__}")
    check_type("optimizer", optimizer, torch.optim.Optimizer, allow_none=True)
    check_derived(teacher, student)
    dj, src = _read_json(config_file, teacher)
    groups = dj.groups or chunk(find_blocks(teacher), dj.group_size)
    check_groups(groups, teacher, student, src)
    first = _check_loader(train_loader)
    x0 = model_input(sample, first)
    if pipeline.uninitialised_layers(student):
        calibrate(student, train_loader, sample, dj.batch_num)
    groups = merge_pruned_boundaries(teacher, student, move_folded_ends(teacher, student, groups, x0), x0)
    if optimizer is None:
        params = [p for p in student.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=float(lr), weight_decay=0.0)
    modes = {n: m.training for n, m in teacher.named_modules()}
    teacher.eval()
    student.train()
    # The teacher runs in eval mode, so the student's dropout is off and, unless channels were
    # pruned, its BatchNorm (folded or not) uses the teacher's running statistics: batch
    # statistics would make it chase a different function. A filter-pruned student keeps its
    # BatchNorm training: the teacher's statistics do not describe the pruned layers' outputs
    # (MnistNet, 50 % filters + INT8, 1 epoch at lr 3e-3 on shuffled batches: 64 % test accuracy
    # with them frozen, 96 % with them re-estimated). Its running statistics are recomputed
    # after each epoch over the whole loader, every batch alike (``reestimate_bn``): left to the
    # momentum they are the last batches', which describe the data only where every batch mixes
    # it (MnistNet as above, 10 epochs at lr 3e-3, shuffled: 96.8 % with them, 98.1 % recomputed,
    # the retrain flow's 98.3 %). Batches that each hold one class (a class-sorted dataset read in
    # order) still fail, the optimizer seeing one class at a time: hence the warning below.
    pruned = _pruned(teacher, student)
    frozen = (nn.modules.dropout._DropoutNd,) if pruned else \
        (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    if pruned and _reads_in_order(train_loader):
        logger.warning("distill: train_loader reads its dataset in order (no shuffle): a filter-pruned student "
                       "relearns its pruned layers from these batches, and batches that each hold one kind of "
                       "sample (a dataset sorted by class) leave it far below the teacher; give "
                       "DataLoader(..., shuffle=True)")
    for mod in student.modules():
        if isinstance(mod, frozen):
            mod.eval()
    try:
        after_epoch = (lambda: reestimate_bn(student, train_loader, sample)) if pruned else None
        losses = train_groups(teacher, student, groups, train_loader, epochs, optimizer, sample, loss, dj.data_dump,
                              after_epoch=after_epoch)
    finally:
        for n, m in teacher.named_modules():
            m.training = modes.get(n, m.training)
    student.eval()
    logger.info("distill: %d group(s), %d step(s), loss %.4g -> %.4g", len(groups), len(losses), losses[0],
                losses[-1])
    return compress_model


def save_distill_model(model, save_path, input_data, record_file=None, input_names=None, output_names=None,
                       dynamic_axes=None, *, fp32_model=None, report=None):
    """Write ``{save_path}_fake_quant_model.onnx`` and ``{save_path}_deploy_model.onnx`` of a
    distilled model; ``record_file`` None: the record the model was created with.

    Keyword-only, beyond upstream (docs/checking.md): ``fp32_model`` is also exported as
    ``{save_path}_fp32_model.onnx``; ``report`` (a callable taking one str) gets the one-line
    summary of ``openamct verify``."""
    from openamct.export.fp32_reference import after_save, check_after_save, fp32_path

    model = unwrap(model)
    check_type("model", model, nn.Module)
    check_type("save_path", save_path, str)
    check_type("record_file", record_file, str, allow_none=True)
    check_input_data(input_data)
    check_names("input_names", input_names)
    check_names("output_names", output_names)
    check_dynamic_axes(dynamic_axes)
    fake, deploy = save_paths(save_path)
    single_op = getattr(model, "_openamct", None) is None and holds_qat_modules(model)
    for path in (fake, deploy):
        check_output("save_path", path, "onnx", {} if single_op else {"record_file": record_file}, make_folder=True)
    fp32 = check_after_save(fp32_model, report)
    if fp32 is not None:
        check_output("fp32_model", fp32_path(fake), "onnx", make_folder=True)
    names = (input_names, output_names, dynamic_axes)
    if single_op:  # a student built from QAT modules: exported and converted as convert_qat_model does
        logger.info("save_distill_model: single-op QAT modules: record_file is not read")
        save_qat_model(model, save_path, input_data, *names)
        if fp32 is not None or report is not None:
            after_save(fake, deploy, input_data, fp32, report, *names)
        return fake, deploy
    if record_file:
        check_output("record_file", record_file, "record", {"save_path": fake}, make_folder=True)
    fake, deploy = pipeline.save(model, save_path, input_data, record_file, *names)
    if any(isinstance(m, CompressedLayer) and getattr(m.wts_quant, "format", None) is not None
           and m.wts_quant.format.bits == 4 for m in model.modules()):
        import onnx

        from openamct.distill.int4_deploy import pack_int4_weights

        proto = onnx.load(deploy)
        n = pack_int4_weights(proto, INT4_DEPLOY_FORMAT)
        atomic_write_bytes(deploy, proto.SerializeToString())
        logger.info("save_distill_model: %d INT4 weight(s) stored as 4 bits (%s) in %s", n, INT4_DEPLOY_FORMAT, deploy)
    if fp32 is not None or report is not None:
        after_save(fake, deploy, input_data, fp32, report, *names)
    return fake, deploy
