"""The search report as a PNG, in the demo's style (matplotlib, imported only when called)."""

from __future__ import annotations

import logging

from openamct.search.report import SearchReport

logger = logging.getLogger(__name__)

__all__ = ["render_search_chart"]


def render_search_chart(report: SearchReport, path: str) -> None:
    """Three panels per group: channels before / kept, the ratio chosen against the group's
    MACs share, and the mean sensitivity. Deterministic bytes for the same report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    names = [r.producers[0] + (f" +{len(r.producers) - 1}" if len(r.producers) > 1 else "") for r in rows]
    xs = list(range(len(rows)))
    fig, ax = plt.subplots(1, 3, figsize=(14, 4.5))
    fig.suptitle(f"openamct prune-search: budget {report.budget}, asked {report.compress_ratio:g}x, "
                 f"MACs {report.macs_before / 1e6:.2f} M -> {report.macs_after / 1e6:.2f} M "
                 f"({report.macs_ratio:.2f}x fewer)")

    a = ax[0]
    a.bar([i - 0.2 for i in xs], [r.channels for r in rows], 0.4, label="before", color="#bbbbbb")
    a.bar([i + 0.2 for i in xs], [r.kept for r in rows], 0.4, label="kept", color="#1f77b4")
    a.set_title("output channels per group")
    a.legend()

    a = ax[1]
    a.bar([i - 0.2 for i in xs], [100 * r.macs_share for r in rows], 0.4, label="MACs share (%)", color="#ff7f0e")
    a.bar([i + 0.2 for i in xs], [100 * r.ratio for r in rows], 0.4, label="prune ratio (%)", color="#2ca02c")
    for i, r in enumerate(rows):
        if r.fixed:
            a.text(i, 2, "override", ha="center", fontsize=8)
    a.set_ylim(0, 105)
    a.set_title("where the MACs are, and what was cut")
    a.legend(fontsize=8)

    a = ax[2]
    a.bar(xs, [r.sensitivity for r in rows], color="#d62728")
    a.set_yscale("symlog", linthresh=max(1e-12, min((r.sensitivity for r in rows if r.sensitivity > 0),
                                                    default=1e-6)))
    a.set_title("mean channel sensitivity (Taylor)")
    for a in ax:
        a.set_xticks(xs, names, rotation=30, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    logger.info("chart written: %s", path)
