"""The search's two config files: the AutoChannelPruneConfig it reads (``config``), the
retrain config of its ``override_prune_cfg``, and the retrain config it writes (``output_cfg``).

Every problem is a ValueError (``ConfigError``) naming the file and the field, raised before
any graph is captured or gradient computed.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from google.protobuf import text_format

from openamct._atomic import atomic_write_bytes
from openamct.config.auto_channel_prune_config_pb2 import AutoChannelPruneConfig
from openamct.config.parse import ConfigError, load_config, locate, read_config_file
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig
from openamct.output_paths import folder_for, probe_folder

logger = logging.getLogger(__name__)

__all__ = ["SearchSettings", "load_search_config", "check_output_path", "write_retrain_config"]


@dataclass(frozen=True)
class SearchSettings:
    compress_ratio: float
    ascend_optimized: bool
    max_prune_ratio: float
    test_iteration: int
    override: AMCTRetrainConfig  # empty when the config names no override_prune_cfg
    override_path: str | None
    path: str


def _f32(value: float) -> float:
    return float(f"{value:.7g}")  # what the user wrote, not its float32 neighbour


def _parse(path: str) -> tuple[AutoChannelPruneConfig, str]:
    raw = read_config_file(path, "config")
    src = f"config {path!r}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{src} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    msg = AutoChannelPruneConfig()
    try:
        # Merge, not Parse: a required field that is missing gets our own message below.
        text_format.Merge(text, msg)
    except text_format.ParseError as exc:
        raise ConfigError(f"{src}: line {exc} (fields of AutoChannelPruneConfig: compress_ratio, "
                          "ascend_optimized, max_prune_ratio, test_iteration, override_prune_cfg)") from None
    except (ValueError, OverflowError, RecursionError) as exc:
        raise ConfigError(f"{src}: {type(exc).__name__}: {exc}") from None
    return msg, text


def _override(path: str, config_path: str) -> tuple[AMCTRetrainConfig, str]:
    """The retrain config named by ``override_prune_cfg``: as written, or next to ``config``."""
    if not os.path.isfile(path) and not os.path.isabs(path):
        beside = os.path.join(os.path.dirname(os.path.abspath(config_path)), path)
        path = beside if os.path.isfile(beside) else path
    cfg, text = load_config(path, "override_prune_cfg")
    src = f"override_prune_cfg {path!r}"
    globals_ = [f for f in ("prune_config", "retrain_data_quant_config", "retrain_weight_quant_config")
                if cfg.HasField(f)]
    if globals_:
        raise ConfigError(f"{src}: {locate(text, globals_[0])}{globals_[0]}: an override_prune_cfg holds only "
                          "skip lists and override_layer_configs / override_layer_types (the search decides "
                          "the rest); remove the global field")
    for o in list(cfg.override_layer_configs) + list(cfg.override_layer_types):
        if o.HasField("retrain_data_quant_config") or o.HasField("retrain_weight_quant_config"):
            who = getattr(o, "layer_name", "") or getattr(o, "layer_type", "")
            raise ConfigError(f"{src}: {locate(text, 'retrain_data_quant_config') or locate(text, 'retrain_weight_quant_config')}"
                              f"override for {who!r} holds quantization settings: the searched config must stay "
                              "prune-only (add quantization to it afterwards for create_compressed_retrain_model)")
    return cfg, path


def load_search_config(path: str) -> SearchSettings:
    msg, text = _parse(path)
    src = f"config {path!r}"
    if not msg.HasField("compress_ratio"):
        raise ConfigError(f"{src}: required field compress_ratio is missing (e.g. 'compress_ratio: 2' for "
                          "half the MACs of the prunable layers)")
    ratio = _f32(msg.compress_ratio)
    if not math.isfinite(ratio) or ratio <= 1:
        raise ConfigError(f"{src}: {locate(text, 'compress_ratio')}compress_ratio must be > 1 (how many times "
                          f"fewer MACs), got {ratio:g}")
    max_ratio = _f32(msg.max_prune_ratio)
    if not (0 < max_ratio <= 1):
        raise ConfigError(f"{src}: {locate(text, 'max_prune_ratio')}max_prune_ratio must be in (0, 1], "
                          f"got {max_ratio:g}")
    if msg.test_iteration < 1:
        raise ConfigError(f"{src}: {locate(text, 'test_iteration')}test_iteration must be >= 1, "
                          f"got {msg.test_iteration}")
    override, override_path = AMCTRetrainConfig(), None
    if msg.HasField("override_prune_cfg"):
        if not msg.override_prune_cfg:
            raise ConfigError(f"{src}: {locate(text, 'override_prune_cfg')}override_prune_cfg is empty: name a "
                              "retrain config file or leave the field out")
        override, override_path = _override(msg.override_prune_cfg, path)
    return SearchSettings(ratio, bool(msg.ascend_optimized), max_ratio, int(msg.test_iteration),
                          override, override_path, path)


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output_path(output_cfg: str, inputs: dict[str, str | None]) -> None:
    """``output_cfg`` must be a writable place that is none of the call's input files."""
    if not output_cfg:
        raise ValueError("output_cfg must not be empty")
    for arg, path in inputs.items():
        if path and _same_file(output_cfg, path):
            raise ValueError(f"output_cfg {output_cfg!r} is the same file as {arg} {path!r}: the search never "
                             "overwrites one of its inputs; write it somewhere else")
    if os.path.isdir(output_cfg):
        raise ValueError(f"output_cfg {output_cfg!r} is a folder: give a file name such as found.cfg")
    probe_folder("output_cfg", output_cfg, make_folder=True)  # made when it is written, as upstream does


def write_retrain_config(path: str, override: AMCTRetrainConfig, ratios: dict[str, tuple[float, bool]],
                         header: str) -> AMCTRetrainConfig:
    """The user's skip/override entries, then one filter_pruner override per searched layer
    (``ratios``: layer -> (prune_ratio, ascend_optimized)); written atomically."""
    cfg = AMCTRetrainConfig()
    cfg.CopyFrom(override)
    for name, (ratio, ascend) in ratios.items():
        o = cfg.override_layer_configs.add()
        o.layer_name = name
        b = o.prune_config.filter_pruner.balanced_l2_norm_filter_prune
        b.prune_ratio = ratio
        b.ascend_optimized = ascend
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    with folder_for(path):
        atomic_write_bytes(path, (comment + text_format.MessageToString(cfg)).encode("utf-8"))
    return cfg
