"""`openamct report RECORD`: what a record file holds, per layer."""

from __future__ import annotations

import json
import os

from openamct.record import attrs
from openamct.record.file_io import LARGE_RECORD_BYTES, read_record
from openamct.techniques.sparsity24 import masks_in_record


def _fast_text(path: str):
    """The large path's record parser for a record of ``LARGE_RECORD_BYTES`` and more (a large
    model's); None (``text_format``) for the rest."""
    try:
        large = os.path.getsize(path) >= LARGE_RECORD_BYTES
    except OSError:
        return None  # read_record names the file
    if not large:
        return None
    from openamct.large.attach import RECORD_TEXT

    return RECORD_TEXT


def report_record(path: str) -> dict:
    record = read_record(path, _fast_text(path))
    layers: dict[str, dict] = {}

    def entry(name: str) -> dict:
        return layers.setdefault(name, {"layer": name})

    for e in record.record:
        v = e.value
        q = entry(e.key)
        q["scale_d"] = float(v.scale_d)
        q["offset_d"] = int(v.offset_d)
        if len(v.scale_w):
            q["scale_w"] = {"count": len(v.scale_w), "min": min(v.scale_w), "max": max(v.scale_w)}
    for name, mask in masks_in_record(record, path).items():
        total = mask.numel()
        entry(name)["sparsity_2_4"] = {"mask_shape": list(mask.shape), "zeros": round(1 - float(mask.sum()) / max(total, 1), 4)}
    groups = []
    for idx, pr in enumerate(record.prune_record):
        if pr.HasField("selective_prune"):
            continue
        producers = [p.name for p in pr.producer]
        removed = None
        for node in list(pr.producer) + list(pr.consumer):
            begin, end = attrs.get_int(node, "begin", 0), attrs.get_int(node, "end", 0)
            idx_list = attrs.get_ints(node, "prune_index") or []
            if node in pr.producer:
                removed = len(idx_list)
                f = entry(node.name)
                f["channels"] = {"before": end - begin, "kept": end - begin - len(idx_list), "group": idx}
        groups.append({"group": idx, "producers": producers, "consumers": [c.name for c in pr.consumer],
                       "removed": removed})
    return {"record": path, "layers": list(layers.values()), "filter_groups": groups}


def format_report(report: dict, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(report, indent=2)
    lines = [f"record: {report['record']}", ""]
    if not report["layers"] and not report["filter_groups"]:
        lines.append("no entries yet. A record holds filter-prune groups from create_*, 2:4 masks from the first "
                     "training batch, and quantization scales from the first eval-mode forward and from save_* "
                     "(docs/record.md).")
        return "\n".join(lines)
    header = ("layer", "kept channels", "2:4 zeros", "scale_d", "offset_d", "scale_w (n, min..max)")
    rows = [header]
    for layer in report["layers"]:
        ch = layer.get("channels")
        sp = layer.get("sparsity_2_4")
        sw = layer.get("scale_w")
        rows.append((layer["layer"],
                     f"{ch['kept']}/{ch['before']}" if ch else "-",
                     f"{100 * sp['zeros']:.1f}%" if sp else "-",
                     f"{layer['scale_d']:.6g}" if "scale_d" in layer else "-",
                     str(layer.get("offset_d", "-")),
                     f"{sw['count']}, {sw['min']:.3g}..{sw['max']:.3g}" if sw else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    if report["filter_groups"]:
        lines.append("")
        for g in report["filter_groups"]:
            lines.append(f"filter group {g['group']}: producers {', '.join(g['producers'])}; "
                         f"{g['removed'] or 0} channels removed; consumers {', '.join(g['consumers'])}")
    return "\n".join(lines)
