"""``PruneReport``: what a ``prune`` call did, filled in place in the caller's sink."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class StageEvent:
    """One step of a prune: which domain and method touched which module, and how."""

    stage: str
    method: str
    module: str
    detail: str


@dataclass
class PruneReport:
    """Upstream's report fields; ``prune(..., report=rep)`` fills ``rep``."""

    backend: str = ""  # huggingface | torch
    params_before: int = 0
    params_after: int = 0
    events: list[StageEvent] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    per_layer_sparsity: dict[str, float] = field(default_factory=dict)
    budget_unreachable: bool = False
    prunable_fraction: float | None = None  # size_budget mode only
    allocation_choice: str | None = None  # uniform | sensitivity
    chosen_ratio: float | None = None  # the ratio the search settled on (search modes)

    def copy_from(self, other: PruneReport) -> None:
        """Take every field of ``other`` into this report."""
        for f in fields(other):
            setattr(self, f.name, getattr(other, f.name))

    def add(self, stage: str, method: str, module: str, detail: str) -> None:
        self.events.append(StageEvent(stage, method, module, detail))

    def add_warning(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def record_layer_sparsity(self, module_path: str, params_before: int, params_after: int) -> None:
        if params_before > 0:
            self.per_layer_sparsity[module_path] = 1.0 - params_after / params_before

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["events"] = [vars(e).copy() for e in self.events]
        d["warnings"] = list(self.warnings)
        d["per_layer_sparsity"] = dict(self.per_layer_sparsity)
        return d
