"""The priority rules every technique's config slice shares, written once.

A retrain config has a global block, ``override_layer_configs`` (by layer name) and
``override_layer_types`` (by torch class name), plus skip lists. Techniques belong to one of two
rule families, which differ only in how a skip list meets an override:

- quantization: override_layer_configs > override_layer_types > skip lists > global; an
  override re-enables a skipped layer;
- pruning: override_layer_configs > override_layer_types > global, but a skip always wins.

A technique's config slice (``Technique.layer_spec``) calls ``winning_block`` with its family
and reads its own fields from the block it gets; it never re-implements the order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from openamct.config.errors import ConfigError, locate
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig


@dataclass(frozen=True)
class Family:
    """One set of priority rules and the config fields that mark a block as using it."""

    name: str
    apis: tuple[str, ...]  # the public API families (create_<api>_retrain_model) that apply it
    skip_layers: tuple[str, ...]  # config fields listing layer names it skips
    skip_types: tuple[str, ...]  # config fields listing layer types it skips
    skip_wins: bool  # True: a skip list wins over overrides
    present: Callable[[object], bool]  # does this block (global or override) configure it?


def _has_quant(block) -> bool:
    return block.HasField("retrain_data_quant_config") or block.HasField("retrain_weight_quant_config")


def _has_prune(block) -> bool:
    return block.HasField("prune_config")


QUANT = Family("quant", ("compressed", "quant"), ("skip_layers", "quant_skip_layers"),
               ("skip_layer_types", "quant_skip_types"), skip_wins=False, present=_has_quant)
PRUNE = Family("prune", ("prune", "compressed"), ("skip_layers", "regular_prune_skip_layers"),
               ("skip_layer_types", "regular_prune_skip_types"), skip_wins=True, present=_has_prune)
FAMILIES = (QUANT, PRUNE)  # the order config fields are read and validated in


def config_order(techniques: Sequence) -> list:
    """The techniques with a config slice, quantization's first: the order config fields are
    read and checked in (the first bad field of a block is the one reported)."""
    return sorted((t for t in techniques if t.family is not None), key=lambda t: FAMILIES.index(t.family))


def blocks(cfg: AMCTRetrainConfig) -> Iterator[tuple[str, object]]:
    """(label, message) for the global config and each override, for messages."""
    yield "global", cfg
    for o in cfg.override_layer_configs:
        yield f"override_layer_configs[layer_name={o.layer_name!r}]", o
    for o in cfg.override_layer_types:
        yield f"override_layer_types[layer_type={o.layer_type!r}]", o


def uses(cfg: AMCTRetrainConfig, family: Family) -> bool:
    """Whether any block of ``cfg`` configures ``family``."""
    return any(family.present(b) for _, b in blocks(cfg))


def skipped(cfg: AMCTRetrainConfig, family: Family, name: str, layer_type: str) -> bool:
    return (any(name in getattr(cfg, f) for f in family.skip_layers)
            or any(layer_type in getattr(cfg, f) for f in family.skip_types))


def winning_block(cfg: AMCTRetrainConfig, family: Family, name: str, layer_type: str) -> tuple[object | None, bool]:
    """(the block whose ``family`` fields apply to this layer, whether a skip list names it).

    Quantization: an override block wins and clears the skip; without one, the global block
    (None when it has no such fields) and the skip flag. Pruning: the first of layer override,
    type override, global that has the fields, and the skip flag, which then wins: the slice
    drops the block (and notes why). The block may hold another technique's variant of the
    family's fields (filter vs 2:4): each slice reads only its own.
    """
    by_name = next((o for o in cfg.override_layer_configs if o.layer_name == name), None)
    by_type = next((o for o in cfg.override_layer_types if o.layer_type == layer_type), None)
    override = next((b for b in (by_name, by_type) if b is not None and family.present(b)), None)
    skip = skipped(cfg, family, name, layer_type)
    if override is not None:
        return override, skip and family.skip_wins
    return (cfg if family.present(cfg) else None), skip


PRUNE_SKIPPED = "prune: skipped (a skip list wins over overrides)"  # the note a pruning slice leaves


def f32(value: float) -> float:
    """The decimal the user wrote, not its float32 neighbour (0.4, not 0.4000000059604645)."""
    return float(f"{value:.7g}")


def prune_kind(block, where: str, text: str, src: str) -> str | None:
    """Which pruner a block's ``prune_config`` names (None without one); an empty one is a
    ConfigError (both pruning techniques read the same field, either may check it first)."""
    if not block.HasField("prune_config"):
        return None
    kind = block.prune_config.WhichOneof("prune_algo")
    if kind is None:
        raise ConfigError(f"{src}: {locate(text, 'prune_config')}{where}.prune_config is empty: "
                          "give filter_pruner or n_out_of_m_pruner")
    return kind
