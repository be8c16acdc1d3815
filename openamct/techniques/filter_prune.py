"""Filter (channel) pruning as a technique: coupled groups decided from the graph and the
weights at create, replayed from the record at restore; channels are physically removed, so
there is nothing left to do at export (the pruned model is simply smaller).

The algorithm lives in ``openamct.sparsity``: ``dependency`` (which layers share channels),
``filter`` (scoring and removal), ``filter_record`` (groups <-> record entries).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from openamct.config.errors import ConfigError, locate
from openamct.config.rules import PRUNE, f32, prune_kind
from openamct.graph.layers import NEVER_CALLED
from openamct.record.scale_offset_record_pb2 import PruneRecord, ScaleOffsetRecord
from openamct.sparsity.group import BlockedGroup, PruneGroup
from openamct.techniques.base import Context, Technique

logger = logging.getLogger(__name__)


@dataclass
class FilterState:
    groups: list[PruneGroup]  # the groups that lose channels
    entries: list[PruneRecord]  # their record entries, as written (restore: as read)
    blocked: list[BlockedGroup] = field(default_factory=list)


@dataclass(frozen=True)
class FilterSpec:
    ratio: float
    ascend_optimized: bool = True


class FilterPruning(Technique):
    name = "filter_prune"
    family = PRUNE
    # Pruned actively (a channel space of their own); other convs only follow their input as
    # consumers (sparsity/dependency.py).
    layer_types = ("Conv1d", "Conv2d", "Linear", "Conv1D")

    def configured_by(self, block) -> bool:
        return block.HasField("prune_config") and block.prune_config.WhichOneof("prune_algo") == "filter_pruner"

    def validate_block(self, b, where: str, text: str, src: str) -> None:
        if prune_kind(b, where, text, src) != "filter_pruner":
            return
        p = b.prune_config
        if p.filter_pruner.WhichOneof("filter_algo") is None:
            raise ConfigError(f"{src}: {locate(text, 'filter_pruner')}{where}.prune_config.filter_pruner is empty: "
                              "give balanced_l2_norm_filter_prune { prune_ratio: ... }")
        r = p.filter_pruner.balanced_l2_norm_filter_prune.prune_ratio
        if not (0.0 < r < 1.0):  # also rejects NaN
            raise ConfigError(f"{src}: {locate(text, 'prune_ratio')}{where}: prune_ratio must be in (0, 1), got {r}")

    def eligible(self, info) -> str | None:
        if info.type not in self.layer_types:
            return f"filter prune: {info.type} is pruned only passively (as a consumer)"
        if info.depthwise:
            return "filter prune: depthwise convs follow their input, never pruned actively"
        if getattr(info, "functional", None) is not None:
            return ("filter prune: its owner computes it with F.linear on its weight (not prunable: the owner's "
                    "code may depend on its width)")
        return None

    def layer_spec(self, cfg, info, api: str, notes: list[str]) -> FilterSpec | None:
        block = self.prune_block(cfg, info, notes)
        if block is None:
            return None
        b = block.prune_config.filter_pruner.balanced_l2_norm_filter_prune
        return FilterSpec(ratio=f32(b.prune_ratio), ascend_optimized=bool(b.ascend_optimized))

    def owns(self, entry: PruneRecord) -> bool:
        return not entry.HasField("selective_prune")

    def wanted(self, ctx: Context) -> bool:
        # Restore replays whatever channel removals the record holds, even when the config now
        # prunes other layers or none: the checkpoint's weights have the recorded shapes.
        return self.in_record(ctx.record) if ctx.restoring else bool(self.planned(ctx.plan))

    def plan(self, ctx: Context) -> FilterState:
        from openamct.sparsity.consistency import consistent_groups
        from openamct.sparsity.dependency import analyse
        from openamct.sparsity.filter import score_and_select
        from openamct.sparsity.filter_record import groups_to_records

        groups, blocked = analyse(ctx.graph, ctx.layers, ctx.plan, ctx.model)
        score_and_select(ctx.model, groups)
        removing = consistent_groups(ctx.model, [g for g in groups if g.removed], ctx.input_data)
        if not removing:
            whole = len(groups)
            logger.warning("filter prune: the config prunes %d layer(s) but removes no channel: %d coupled group(s) "
                           "blocked (see the warnings above), %d left whole because the kept count rounds up to "
                           "all channels (small layers, or ascend_optimized's multiples of 16)",
                           len(self.planned(ctx.plan)), len(blocked), whole)
        record = ScaleOffsetRecord()
        groups_to_records(removing, record)
        return FilterState(removing, list(record.prune_record), blocked)

    def from_record(self, ctx: Context) -> FilterState:
        from openamct.sparsity.filter_record import groups_from_records

        entries = [pr for pr in ctx.record.prune_record if self.owns(pr)]
        return FilterState(groups_from_records(ctx.record, ctx.model), entries)

    def apply(self, ctx: Context, state: FilterState) -> None:
        from openamct.sparsity.consistency import guard_unseen_layers
        from openamct.sparsity.filter import apply_removal

        apply_removal(ctx.model, state.groups)
        if state.groups:
            guard_unseen_layers(ctx.model, [n for n, i in ctx.layers.items()
                                            if i.excluded and i.excluded.startswith(NEVER_CALLED)])

    def decisions(self, record: ScaleOffsetRecord) -> list[tuple[str, bytes]]:
        # Which channels each group lost: same counts, other indices give the same shapes.
        return [(pr.producer[0].name if pr.producer else "?", pr.SerializeToString(deterministic=True))
                for pr in record.prune_record if self.owns(pr)]

    def to_record(self, state: FilterState, layers, record: ScaleOffsetRecord) -> None:
        for entry in state.entries:
            record.prune_record.add().CopyFrom(entry)
