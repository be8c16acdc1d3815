"""Filter pruning's reach on the torchvision and timm zoo families: the share of the compressed
layers' weight that ``balanced_l2_norm_filter_prune { prune_ratio: 0.3 }`` + INT8 removes at
create (tests/zoo/lifecycle.py's "filter0.3+int8" config), one line a family, with the start of
the warnings that say where and why groups stopped. Create only (no training or export): about a
minute for all 48 timm families on one thread.

    python -m benchmarks.prune_reach_zoo [timm|torchvision] [family ...]
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

import torch

import openamct as amct
from tests.zoo.lifecycle import CONFIGS, removed_share, weight_sizes


class _Stops(logging.Handler):
    """Collects the filter-prune 'group(s) not pruned' warnings of one create."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "not pruned" in msg:
            self.lines.append(msg)


def reach(build, folder: str) -> tuple[float, list[str]]:
    """removed_share of one family at the filter config, and the stop warnings logged."""
    model, inputs = build()
    weights = weight_sizes(model)
    cfg = os.path.join(folder, "retrain.cfg")
    with open(cfg, "w") as f:
        f.write(CONFIGS["filter0.3+int8"])
    stops, log = _Stops(), logging.getLogger("openamct")
    log.addHandler(stops)
    log.setLevel(logging.WARNING)
    log.propagate = False  # the stops are printed once, on the family's line
    try:
        c = amct.create_compressed_retrain_model(model, inputs, cfg, os.path.join(folder, "record.txt"))
    finally:
        log.removeHandler(stops)
        log.propagate = True
    return removed_share(weights, c), stops.lines


def main(argv: list[str]) -> None:
    zoo = argv[0] if argv else "timm"
    if zoo == "timm":
        from tests.zoo.timm_families import MODELS as families
        from tests.zoo.timm_families import build
    elif zoo == "hf":
        from benchmarks.reach_families import FAMILIES as families
        from benchmarks.reach_families import build
    else:
        from tests.zoo.torchvision_families import BUILDERS as families
        from tests.zoo.torchvision_families import build
    names = argv[1:] or list(families)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    if zoo == "hf":
        print(f"{'family':24s} {'default':>7s} {'eager':>7s}  where groups stop (default attention)")
    for name in names:
        shares, first = [], ""
        for attention in (None, "eager") if zoo == "hf" else (None,):
            with tempfile.TemporaryDirectory() as folder:
                try:
                    args = (name,) if attention is None else (name, attention)
                    share, stops = reach(lambda a=args: build(*a), folder)
                except Exception as e:  # a family that fails create is reported, the others still run
                    shares.append(f"error: {type(e).__name__}: {str(e)[:200]}")
                    continue
            shares.append(f"{share * 100:5.1f} %")
            if attention is None:
                first = " || ".join(stops).replace("\n", " | ")[:300]
        print(f"{name:24s} {' '.join(f'{s:>7s}' for s in shares)}  {first}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
