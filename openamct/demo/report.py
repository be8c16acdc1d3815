"""The demo's outputs from one ``results`` dict (the same one written to ``results.json``): the
table and summary ``openamct demo`` prints, ``report.md`` and the PNG chart. Everything shown is formatted here, once, so the
terminal, the markdown and the chart cannot disagree.
"""

from __future__ import annotations

import logging

from openamct.export.int8_kernels import saturation_note

logger = logging.getLogger(__name__)

__all__ = ["HEADER", "table_cells", "format_table", "format_summary", "markdown_report", "render_chart"]

HEADER = ("model", "file", "accuracy", "size", "params", "non-zero", "MACs", "latency", "speed-up",
          "smaller")


def _row(m: dict) -> list[str]:
    return [m["name"], m["file"], f"{100 * m['accuracy']:.1f} %", f"{m['size_bytes'] / 1024:.1f} KB",
            f"{m['params']:,}", f"{m['nonzero']:,}", f"{m['macs'] / 1e6:.2f} M",
            f"{m['latency_ms']:.2f} ms", f"{m['speedup']:.1f}x", f"{m['smaller']:.1f}x"]


def table_cells(results: dict) -> list[list[str]]:
    """Header + one row of display strings per model."""
    return [list(HEADER)] + [_row(m) for m in results["models"]]


def format_table(results: dict) -> str:
    cells = table_cells(results)
    widths = [max(len(r[i]) for r in cells) for i in range(len(HEADER))]
    # Text left-aligned, numbers right-aligned.
    fmt = [str.ljust if i < 2 else str.rjust for i in range(len(HEADER))]
    lines = ["  ".join(f(c, w) for f, c, w in zip(fmt, r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(results: dict, out: str) -> str:
    """The table, deploy against FP32 in one line, and where the files went."""
    fp, dep, lat = results["models"][0], results["models"][-1], results["latency"]
    note = [saturation_note("the deploy accuracy above is ORT's here, not the file's")] if lat.get("u8s8_saturates") else []
    return "\n".join([
        "", format_table(results), "",
        f"deploy vs FP32: {100 * (dep['accuracy'] - fp['accuracy']):+.1f} accuracy points, "
        f"{dep['speedup']:.1f}x faster, {dep['smaller']:.1f}x smaller "
        f"(latency: batch {lat['batch']}, {lat['threads']} threads, median of {lat['runs']})",
        *note,
        f"wrote {out}/report.md, chart.png, results.json and the ONNX files in "
        f"{results['timing_s']['total']:.0f} s",
    ])


def _md_table(rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return out + ["| " + " | ".join(r) + " |" for r in rows[1:]]


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown_report(results: dict, chart_name: str) -> str:
    lat, ep, t = results["latency"], results["epochs"], results["timing_s"]
    fp32, deploy = results["models"][0], results["models"][-1]
    lines = [
        "# openamct demo report", "",
        f"MnistNet on MNIST 5k ({results['train_size']} train / {results['test_size']} test real digits), "
        f"config `{results['config']}`, seed {results['seed']}.", "",
        f"FP32: {ep['fp32']} epochs. Compressed with `create_compressed_retrain_model`, retrained "
        f"{ep['retrain']} epochs ({results['total_steps']} steps); interrupted after step "
        f"{results['resumed_at_step']}, resumed with `restore_compressed_retrain_model` from the record "
        "and the checkpoint, saved with `save_compressed_retrain_model`.", "",
        "## Results (ONNX Runtime, test split)", "",
        *_md_table(table_cells(results)), "",
        f"Latency: median of {lat['runs']} interleaved runs, batch {lat['batch']}, ONNX Runtime "
        f"{lat['ort_version']} CPU, {lat['threads']} intra-op threads. MACs are per image, dense: "
        "2:4 zeros are stored and multiplied on CPU (only sparse tensor cores skip them).", "",
        f"Deploy vs FP32: {100 * (deploy['accuracy'] - fp32['accuracy']):+.1f} points, "
        f"{deploy['speedup']:.1f}x faster, {deploy['smaller']:.1f}x smaller on disk.", "",
        f"PyTorch accuracy: FP32 {100 * results['torch_accuracy']['fp32']:.1f} %, compressed (eval) "
        f"{100 * results['torch_accuracy']['compressed']:.1f} %.", "",
        "## Per layer", "",
    ]
    rows = [["layer", "type", "kept channels", "2:4 zeros", "scale_d", "scale_w (min..max)"]]
    for ly in results["layers"]:
        rows.append([ly["layer"], ly["type"], f"{ly['channels_kept']}/{ly['channels_before']}",
                     "-" if ly["zeros_2_4"] is None else f"{100 * ly['zeros_2_4']:.0f} %",
                     _fmt(ly["scale_d"], ".4g"),
                     "-" if ly["scale_w_min"] is None else f"{ly['scale_w_min']:.3g}..{ly['scale_w_max']:.3g}"])
    lines += _md_table(rows)
    lines += ["", f"![chart]({chart_name})", "", "## Time (s)", "",
              ", ".join(f"{k} {v:.1f}" for k, v in t.items()), ""]
    return "\n".join(lines)


def render_chart(results: dict, path: str) -> None:
    """Six panels: kept channels, 2:4 zeros and quantization scales per layer; accuracy,
    latency and size per model. Deterministic bytes for the same ``results``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, models = results["layers"], results["models"]
    names = [ly["layer"] for ly in layers]
    xs = list(range(len(layers)))
    fig, ax = plt.subplots(2, 3, figsize=(14, 7.5))
    fig.suptitle(f"openamct demo: MnistNet, {results['config']}")

    a = ax[0][0]
    a.bar([i - 0.2 for i in xs], [ly["channels_before"] for ly in layers], 0.4, label="FP32", color="#bbbbbb")
    a.bar([i + 0.2 for i in xs], [ly["channels_kept"] for ly in layers], 0.4, label="kept", color="#1f77b4")
    a.set_title("output channels (filter pruning)")
    a.legend()

    a = ax[0][1]
    zeros = [0.0 if ly["zeros_2_4"] is None else 100 * ly["zeros_2_4"] for ly in layers]
    a.bar(xs, zeros, color="#2ca02c")
    for i, ly in enumerate(layers):
        if ly["zeros_2_4"] is None:
            a.text(i, 2, "no 2:4", ha="center", fontsize=8)
    a.set_ylim(0, 100)
    a.set_title("weights zeroed by 2:4 (%)")

    a = ax[0][2]
    sd = [(i, ly["scale_d"]) for i, ly in enumerate(layers) if ly["scale_d"]]
    a.scatter([i for i, _ in sd], [s for _, s in sd], color="#d62728", label="activation scale_d", zorder=3)
    for i, ly in enumerate(layers):
        if ly["scale_w_min"]:
            a.vlines(i, ly["scale_w_min"], ly["scale_w_max"], color="#9467bd", lw=6, alpha=0.7,
                     label="weight scale_w range" if i == 0 else None)
    a.set_yscale("log")
    a.set_title("INT8 scales")
    a.legend(fontsize=8)
    for a in ax[0]:
        a.set_xticks(xs, names, rotation=30, fontsize=8)

    labels = [m["name"] for m in models]
    colors = ["#7f7f7f", "#ff7f0e", "#1f77b4"][: len(models)]
    accs = [100 * m["accuracy"] for m in models]
    panels = [
        (ax[1][0], accs, "test accuracy (%)", [f"{v:.1f}" for v in accs]),
        (ax[1][1], [m["latency_ms"] for m in models], f"ORT latency, batch {results['latency']['batch']} (ms)",
         [f"{m['latency_ms']:.2f}\n{m['speedup']:.1f}x" for m in models]),
        (ax[1][2], [m["size_bytes"] / 1024 for m in models], "size on disk (KB)",
         [f"{m['size_bytes'] / 1024:.0f}\n{m['smaller']:.1f}x" for m in models]),
    ]
    for a, values, title, notes in panels:
        a.bar(labels, values, color=colors)
        for i, (v, note) in enumerate(zip(values, notes, strict=True)):
            a.text(i, v, note, ha="center", va="bottom", fontsize=8)
        a.set_title(title)
        a.margins(y=0.25)
    ax[1][0].set_ylim(max(0.0, min(accs) - 5), 100)
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    logger.info("chart written: %s", path)
