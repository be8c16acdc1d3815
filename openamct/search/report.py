"""What a search found, as data (``SearchReport``) and as the table ``openamct prune-search``
prints: one row per coupled group with its sensitivity, its MACs share and the ratio chosen,
then the MACs (and, for the latency budget, the milliseconds) before and after."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GroupRow", "SearchReport", "format_search_report"]


@dataclass
class GroupRow:
    producers: list[str]
    channels: int
    kept: int
    ratio: float
    sensitivity: float  # mean per-channel score of the group (sum over its producers)
    lost: float  # share of the group's summed sensitivity that the removed channels carried
    macs_share: float  # the group's share of the prunable MACs (SearchSpace.group_macs): the rows add up to 1
    fixed: bool  # from override_prune_cfg
    searchable: bool  # False: alignment or max_prune_ratio leaves it no smaller size


@dataclass
class SearchReport:
    budget: str
    compress_ratio: float
    output_cfg: str
    macs_before: int  # prunable layers, per sample
    macs_after: float
    model_macs_before: int  # every conv/linear of the model, per sample
    model_macs_after: float
    rows: list[GroupRow] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    latency: dict = field(default_factory=dict)  # budget="latency": predicted/measured ms, table build time
    seconds: float = 0.0

    @property
    def macs_ratio(self) -> float:
        return self.macs_before / self.macs_after if self.macs_after else float("inf")

    @property
    def model_macs_ratio(self) -> float:
        return self.model_macs_before / self.model_macs_after if self.model_macs_after else float("inf")

    def as_dict(self) -> dict:
        return {"budget": self.budget, "compress_ratio": self.compress_ratio, "output_cfg": self.output_cfg,
                "macs_before": self.macs_before, "macs_after": self.macs_after,
                "model_macs_before": self.model_macs_before, "model_macs_after": self.model_macs_after,
                "groups": [vars(r) for r in self.rows], "blocked": self.blocked, "latency": self.latency,
                "seconds": self.seconds}


def _name(row: GroupRow, width: int = 44) -> str:
    s = " + ".join(row.producers)
    return s if len(s) <= width else s[:width - 3] + "..."


def format_search_report(r: SearchReport) -> str:
    cells = [["group (producers)", "channels", "kept", "ratio", "sensitivity", "lost", "MACs share", "note"]]
    for row in r.rows:
        note = "override_prune_cfg" if row.fixed else ("" if row.searchable else "too small to prune")
        cells.append([_name(row), str(row.channels), str(row.kept), f"{row.ratio:.3f}", f"{row.sensitivity:.3g}" if row.searchable or row.fixed else "-",
                      f"{100 * row.lost:.1f} %", f"{100 * row.macs_share:.1f} %", note])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) if i in (0, 7) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             .rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["", f"MACs per sample, prunable layers: {r.macs_before:,} -> {r.macs_after:,.0f} "
                  f"({r.macs_ratio:.2f}x fewer; asked {r.compress_ratio:g}x" + (")" if r.budget == "macs" else
                                                                                 " faster)"),
              f"MACs per sample, whole model:     {r.model_macs_before:,} -> {r.model_macs_after:,.0f} "
              f"({r.model_macs_ratio:.2f}x fewer)"]
    lat = r.latency
    if lat:
        lines.append(f"ONNX Runtime latency (batch {lat['batch']}, {lat['threads']} threads): FP32 "
                     f"{lat['fp32_ms']:.2f} ms -> pruned {lat['pruned_ms']:.2f} ms measured "
                     f"({lat['speedup']:.2f}x; table predicted {lat['predicted_speedup']:.2f}x); "
                     f"table of {lat['points']} points built in {lat['table_s']:.1f} s")
    if r.blocked:
        lines.append(f"not searched ({len(r.blocked)} blocked group(s)): " + "; ".join(r.blocked[:3])
                     + (" ..." if len(r.blocked) > 3 else ""))
    lines.append(f"wrote {r.output_cfg} in {r.seconds:.1f} s")
    return "\n".join(lines)
