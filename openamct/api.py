"""The AMCT-named public functions (docs/dev/reference.md, API contract). Thin: check the arguments, then call the pipeline.

Signatures and argument order follow upstream amct_pytorch exactly, so AMCT scripts switch by
changing the import line (``import openamct as amct``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch import nn

from openamct import pipeline
from openamct._checks import (
    check_dynamic_axes,
    check_input_data,
    check_model,
    check_names,
    check_type,
    save_paths,
    unwrap,
)
from openamct.output_paths import check_output, check_path_syntax, folder_for, same_file

logger = logging.getLogger(__name__)


def _check_common(model: Any, input_data: Any, **paths: Any) -> nn.Module:
    model = check_model(model)
    check_input_data(input_data)
    for name, value in paths.items():
        check_type(name, value, str, allow_none=name in ("state_dict_name", "config_defination"))
    return model


def _check_save(model: Any, save_path: Any, input_data: Any, input_names: Any, output_names: Any,
                dynamic_axes: Any, record_file: Any = "", config_file: str | None = None) -> nn.Module:
    model = unwrap(model)
    check_type("model", model, nn.Module)
    check_type("save_path", save_path, str)
    check_type("record_file", record_file, str)
    check_input_data(input_data)
    check_names("input_names", input_names)
    check_names("output_names", output_names)
    check_dynamic_axes(dynamic_axes)
    fake, deploy = save_paths(save_path)
    inputs = {"config_file": config_file, "record_file": record_file or None}
    check_output("save_path", fake, "onnx", inputs, make_folder=True)
    check_output("save_path", deploy, "onnx", inputs, make_folder=True)
    if record_file:
        check_output("record_file", record_file, "record", {"config_file": config_file, "save_path": fake},
                     make_folder=True)
        check_output("record_file", record_file, "record", {"save_path": deploy}, make_folder=True)
    return model


def _check_extras(save_path: str, fp32_model: Any, report: Any) -> nn.Module | None:
    """save_*'s keyword-only extras (export/fp32_reference.py), checked before any work."""
    from openamct.export.fp32_reference import check_after_save, fp32_path

    plain = check_after_save(fp32_model, report)
    if plain is not None:
        check_output("fp32_model", fp32_path(save_paths(save_path)[0]), "onnx", make_folder=True)
    return plain


def _after_save(save_path, input_data, fp32_model, report, input_names, output_names, dynamic_axes,
                placement=None) -> None:
    if fp32_model is None and report is None:
        return
    from openamct.export.fp32_reference import after_save

    fake, deploy = save_paths(save_path)
    after_save(fake, deploy, input_data, fp32_model, report, input_names, output_names, dynamic_axes)
    if placement is not None and report is not None:
        from openamct.export.placement import placement_summary, read_decision

        decision = read_decision(deploy)
        if decision is not None:
            report(placement_summary(decision))


def _check_placement(placement) -> None:
    from openamct.export.placement import check_placement

    check_placement(placement)


def _check_inputs_distinct(**paths: Any) -> None:
    """Restore reads every one of these, and the record is rewritten during training: no two
    may be the same file."""
    named = [(k, v) for k, v in paths.items() if isinstance(v, str) and v]
    for k, v in named:
        check_path_syntax(k, v)
    for i, (k, v) in enumerate(named):
        for k2, v2 in named[i + 1:]:
            if same_file(v, v2):
                raise ValueError(f"{k} and {k2} are the same file {v!r}: give each its own file "
                                 "(the record is rewritten during training and would overwrite the other)")


def _check_large(large_model: Any) -> None:
    check_type("large_model", large_model, bool, allow_none=True)


def _create(api: str, model, input_data, config_defination, record_file, large_model) -> nn.Module:
    model = _check_common(model, input_data, config_defination=config_defination, record_file=record_file)
    check_type("config_defination", config_defination, str)
    _check_large(large_model)
    check_output("record_file", record_file, "record", {"config_defination": config_defination}, make_folder=True)
    return pipeline.create(model, input_data, config_defination, record_file, api, large_model=large_model)


def _restore(api: str, model, input_data, large_model, **paths) -> nn.Module:
    """``paths`` in the caller's argument order, so the first wrong one is the one named."""
    model = _check_common(model, input_data, **paths)
    check_type("config_defination", paths["config_defination"], str)
    _check_large(large_model)
    _check_inputs_distinct(**{k: v for k, v in paths.items() if k != "state_dict_name"})
    return pipeline.restore(model, input_data, paths["config_defination"], paths["record_file"],
                            paths["pth_file"], paths["state_dict_name"], api, large_model=large_model)


# -- 2:4 structured sparsity and channel pruning ("prune" family) --------------------------------

def create_prune_retrain_model(model, input_data, config_defination, record_file, *, large_model=None):
    """Return a copy of ``model`` pruned as ``config_defination`` says (filter pruning and/or 2:4);
    the decisions go to ``record_file``. ``large_model``: the large-model switch
    (docs/large-models.md; None: taken for CPU models from 200M parameters)."""
    return _create("prune", model, input_data, config_defination, record_file, large_model)


def restore_prune_retrain_model(model, input_data, record_file, config_defination, pth_file, state_dict_name=None,
                                *, large_model=None):
    """Rebuild the pruned model from the original ``model`` and ``record_file``, then load ``pth_file``."""
    return _restore("prune", model, input_data, large_model, record_file=record_file,
                    config_defination=config_defination, pth_file=pth_file, state_dict_name=state_dict_name)


def save_prune_retrain_model(model, save_path, input_data, input_names=None, output_names=None, dynamic_axes=None,
                             *, fp32_model=None, report=None, placement=None):
    """Fold the masks/pruning into the weights and write the two ONNX files (identical here).

    Keyword-only, beyond upstream (docs/checking.md): ``fp32_model``, the float model you
    compressed, is also exported as ``{save_path}_fp32_model.onnx`` (same names and axes);
    ``report``, a callable taking one str (``print``, a logger's ``info``), gets the one-line
    summary of ``openamct verify``: deploy vs FP32 speed in ONNX Runtime, agreement, float ops left.
    ``placement``: accepted as on the other save_* (both files are float here: nothing to place)."""
    model = _check_save(model, save_path, input_data, input_names, output_names, dynamic_axes)
    _check_placement(placement)
    fp32_model = _check_extras(save_path, fp32_model, report)
    pipeline.save(model, save_path, input_data, None, input_names, output_names, dynamic_axes, placement)
    _after_save(save_path, input_data, fp32_model, report, input_names, output_names, dynamic_axes, placement)


# -- combined sparsity + quantization ("compressed" family) -------------------------------------

def create_compressed_retrain_model(model, input_data, config_defination, record_file, *, large_model=None):
    """Prune channels, then 2:4, then insert INT8 quantizers, as ``config_defination`` says.
    ``large_model``: the large-model switch (docs/large-models.md)."""
    return _create("compressed", model, input_data, config_defination, record_file, large_model)


def restore_compressed_retrain_model(model, input_data, config_defination, record_file, pth_file, state_dict_name=None,
                                     *, large_model=None):
    """Replay ``record_file`` on the original ``model``, insert the quantizers, load ``pth_file``."""
    return _restore("compressed", model, input_data, large_model, config_defination=config_defination,
                    record_file=record_file, pth_file=pth_file, state_dict_name=state_dict_name)


def save_compressed_retrain_model(model, record_file, save_path, input_data, input_names=None, output_names=None,
                                  dynamic_axes=None, *, fp32_model=None, report=None, placement=None):
    """Write ``{save_path}_fake_quant_model.onnx`` and ``{save_path}_deploy_model.onnx``.

    Keyword-only, beyond upstream (docs/checking.md): ``fp32_model``, the float model you
    compressed, is also exported as ``{save_path}_fp32_model.onnx`` (same names and axes);
    ``report``, a callable taking one str (``print``, a logger's ``info``), gets the one-line
    summary of ``openamct verify``: deploy vs FP32 speed in ONNX Runtime, agreement, float ops left.
    ``placement="latency"`` keeps float the blocks whose INT8 form runs slower than their float
    form in ONNX Runtime on this machine, timed at save time (docs/export.md); the decision is
    in the deploy file's metadata and, with ``report``, in one more line."""
    model = _check_save(model, save_path, input_data, input_names, output_names, dynamic_axes, record_file)
    _check_placement(placement)
    fp32_model = _check_extras(save_path, fp32_model, report)
    pipeline.save(model, save_path, input_data, record_file, input_names, output_names, dynamic_axes, placement)
    _after_save(save_path, input_data, fp32_model, report, input_names, output_names, dynamic_axes, placement)


# -- quantization-aware training only ("quant" family) --------------------------------------------

def create_quant_retrain_config(config_file, model, input_data, config_defination=None):
    """Write the per-layer QAT config (JSON) for ``model`` to ``config_file``: from the retrain
    ``config_defination`` (.cfg) when given, else every supported layer with default settings."""
    from openamct.techniques.quant_json import write_quant_json

    check_type("config_file", config_file, str)
    model = _check_common(model, input_data, config_defination=config_defination)
    check_output("config_file", config_file, "quant_json", {"config_defination": config_defination}, make_folder=True)
    analysis = pipeline.analyse(pipeline.deep_copy(model), input_data, config_defination, "quant")
    with folder_for(config_file):
        write_quant_json(config_file, analysis.plan, analysis.techniques)


def create_quant_retrain_model(config_file, model, record_file, input_data, *, large_model=None):
    """Insert INT8 QAT quantizers as ``config_file`` (JSON from create_quant_retrain_config, or a .cfg) says.
    ``large_model``: the large-model switch (docs/large-models.md)."""
    check_type("config_file", config_file, str)
    model = _check_common(model, input_data, record_file=record_file)
    _check_large(large_model)
    check_output("record_file", record_file, "record", {"config_file": config_file}, make_folder=True)
    return pipeline.create(model, input_data, config_file, record_file, "quant", config_arg="config_file",
                           large_model=large_model)


def restore_quant_retrain_model(config_file, model, record_file, input_data, pth_file, state_dict_name=None,
                                *, large_model=None):
    """Rebuild the QAT model from the original ``model`` and load ``pth_file``. A record that
    holds entries is replayed (and checked against the model); a new path, or an empty file, is
    written as create writes it, the layers built from ``config_file`` (upstream's restore
    takes the record path as an output)."""
    check_type("config_file", config_file, str)
    model = _check_common(model, input_data, record_file=record_file, pth_file=pth_file,
                          state_dict_name=state_dict_name)
    _check_large(large_model)
    _check_inputs_distinct(config_file=config_file, record_file=record_file, pth_file=pth_file)
    replay = os.path.isfile(record_file) and os.path.getsize(record_file) > 0
    if not replay:
        check_output("record_file", record_file, "record", {"config_file": config_file, "pth_file": pth_file},
                     make_folder=True)
    return pipeline.restore(model, input_data, config_file, record_file, pth_file, state_dict_name, "quant",
                            config_arg="config_file", replay=replay, large_model=large_model)


def save_quant_retrain_model(config_file, model, record_file, save_path, input_data, input_names=None,
                             output_names=None, dynamic_axes=None, *, fp32_model=None, report=None,
                             placement=None):
    """Write the fake-quant and deploy ONNX models of a QAT model: one returned by
    create/restore_quant_retrain_model, or one holding single-op QAT modules
    (``openamct.nn.module.quantization``), which is exported and converted as
    ``convert_qat_model`` converts its ONNX (``config_file`` and ``record_file`` are then
    unused: the modules carry their own config, and there is no record).

    Keyword-only, beyond upstream (docs/checking.md): ``fp32_model``, the float model you
    compressed, is also exported as ``{save_path}_fp32_model.onnx`` (same names and axes);
    ``report``, a callable taking one str (``print``, a logger's ``info``), gets the one-line
    summary of ``openamct verify``: deploy vs FP32 speed in ONNX Runtime, agreement, float ops left.
    ``placement="latency"`` keeps float the blocks whose INT8 form runs slower than their float
    form in ONNX Runtime on this machine, timed at save time (docs/export.md); the decision is
    in the deploy file's metadata and, with ``report``, in one more line.
    Not for single-op QAT modules (ValueError)."""
    from openamct.nn.convert import holds_qat_modules, save_qat_model

    check_type("config_file", config_file, str)
    _check_placement(placement)
    plain = unwrap(model)
    if isinstance(plain, nn.Module) and getattr(plain, "_openamct", None) is None and holds_qat_modules(plain):
        # config_file and record_file are neither read nor written: not checked as files
        check_type("record_file", record_file, str)
        if placement is not None:
            raise ValueError(f"placement={placement!r}: not available for a model of single-op QAT modules "
                             "(their deploy file is converted from a plain export); save without it")
        model = _check_save(model, save_path, input_data, input_names, output_names, dynamic_axes)
        fp32_model = _check_extras(save_path, fp32_model, report)
        logger.info("save_quant_retrain_model: single-op QAT modules: config_file and record_file are not read")
        save_qat_model(model, save_path, input_data, input_names, output_names, dynamic_axes)
    else:
        model = _check_save(model, save_path, input_data, input_names, output_names, dynamic_axes, record_file,
                            config_file)
        fp32_model = _check_extras(save_path, fp32_model, report)
        pipeline.save(model, save_path, input_data, record_file, input_names, output_names, dynamic_axes, placement)
    _after_save(save_path, input_data, fp32_model, report, input_names, output_names, dynamic_axes, placement)


def convert_qat_model(model_file, save_path):
    """Read ``model_file``, an ONNX exported with ``torch.onnx.export`` from a model holding
    single-op QAT modules, and write ``{save_path}_fake_quant_model.onnx`` and
    ``{save_path}_deploy_model.onnx``."""
    from openamct.nn.convert import convert_qat_model as convert

    convert(model_file, save_path)


# -- channel-prune search --------------------------------------------------------------------------

def auto_channel_prune_search(model, config, input_data, output_cfg, sensitivity="TaylorLossSensitivity",
                              search_alg="GreedySearch", *, budget="macs"):
    """Choose a filter-prune ratio per coupled group so the prunable layers' MACs drop
    ``compress_ratio`` times (``budget="latency"``: the model runs that many times faster in ONNX
    Runtime on this CPU); write the retrain config to ``output_cfg``. ``model`` is not changed.
    Returns the search report (one row per group)."""
    from openamct.search.auto_search import run_search

    model = check_model(model)
    check_type("config", config, str)
    check_type("output_cfg", output_cfg, str)
    check_type("budget", budget, str)
    return run_search(model, config, input_data, output_cfg, sensitivity, search_alg, budget)


# -- deploy file variants --------------------------------------------------------------------------

def dynamic_quantize_lstm(deploy_file, save_path):
    """Write ``deploy_file`` (a deploy ONNX from save_*) to ``save_path`` with every LSTM as ONNX
    Runtime's integer ``com.microsoft.DynamicQuantizeLSTM`` (same int8 weights and scales; input
    and hidden state quantized per step by ORT). The result runs in ONNX Runtime only (not
    OpenVINO); GRUs stay as they are (ORT has no integer GRU). docs/export.md compares the two.
    Returns how many LSTMs were rewritten."""
    check_type("deploy_file", deploy_file, str)
    check_type("save_path", save_path, str)
    check_path_syntax("deploy_file", deploy_file)
    check_path_syntax("save_path", save_path)
    if not os.path.isfile(deploy_file):
        raise ValueError(f"deploy_file {deploy_file!r} does not exist or is not a file")
    if same_file(deploy_file, save_path):
        raise ValueError(f"save_path {save_path!r} is deploy_file: write the rewritten model to another file")
    from openamct.export.recurrent_onnx import dynamic_quantize_lstm as rewrite

    return rewrite(deploy_file, save_path)
