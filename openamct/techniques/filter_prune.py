"""Filter (channel) pruning as a technique: coupled groups decided from the graph and the
weights at create, replayed from the record at restore; channels are physically removed, so
there is nothing left to do at export (the pruned model is simply smaller).

The algorithm lives in ``openamct.prune``: ``dependency`` (which layers share channels),
``filter`` (scoring and removal), ``filter_record`` (groups <-> record entries).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from openamct.config.specs import LayerPlan, Plan
from openamct.prune.group import BlockedGroup, PruneGroup
from openamct.record.scale_offset_record_pb2 import PruneRecord, ScaleOffsetRecord
from openamct.techniques.base import Context, Technique

logger = logging.getLogger(__name__)


@dataclass
class FilterState:
    groups: list[PruneGroup]  # the groups that lose channels
    entries: list[PruneRecord]  # their record entries, as written (restore: as read)
    blocked: list[BlockedGroup] = field(default_factory=list)


class FilterPruning(Technique):
    name = "filter_prune"

    def planned(self, plan: Plan) -> list[LayerPlan]:
        return plan.filter_pruned()

    def owns(self, entry: PruneRecord) -> bool:
        return not entry.HasField("selective_prune")

    def wanted(self, ctx: Context) -> bool:
        # Restore replays whatever channel removals the record holds, even when the config now
        # prunes other layers or none: the checkpoint's weights have the recorded shapes.
        return self.in_record(ctx.record) if ctx.restoring else bool(self.planned(ctx.plan))

    def plan(self, ctx: Context) -> FilterState:
        from openamct.prune.dependency import analyse
        from openamct.prune.filter import score_and_select
        from openamct.prune.filter_record import groups_to_records

        groups, blocked = analyse(ctx.graph, ctx.layers, ctx.plan, ctx.model)
        score_and_select(ctx.model, groups)
        removing = [g for g in groups if g.removed]
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
        from openamct.prune.filter_record import groups_from_records

        entries = [pr for pr in ctx.record.prune_record if self.owns(pr)]
        return FilterState(groups_from_records(ctx.record, ctx.model), entries)

    def apply(self, ctx: Context, state: FilterState) -> None:
        from openamct.prune.filter import apply_removal

        apply_removal(ctx.model, state.groups)

    def to_record(self, state: FilterState, layers, record: ScaleOffsetRecord) -> None:
        for entry in state.entries:
            record.prune_record.add().CopyFrom(entry)
