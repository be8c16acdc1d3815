"""What ``openamct prune-search`` needs besides the search: a model, its weights and batches
from the command line, and the report as text. The CLI prints what this returns."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["random_batches", "search_from_cli"]


def random_batches(model: torch.nn.Module, shape: tuple[int, ...], n: int, seed: int = 0) -> list[list[Any]]:
    """``n`` random batches labelled with the model's own predictions (argmax of a 2-D output):
    without real data the search then ranks channels by how much the model's own decisions
    depend on them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    model.eval()
    for _ in range(n):
        x = torch.randn(shape, generator=g)
        with torch.no_grad():
            y = model(x)
        if not isinstance(y, torch.Tensor) or y.dim() != 2:
            raise ValueError("without --data the labels come from the model's [batch, classes] output; this model "
                             "returns something else: pass --data package.module:factory")
        out.append([x, y.argmax(1)])
    return out


def search_from_cli(args, load_factory) -> str:
    import openamct as amct
    from openamct.search.report import format_search_report

    model = load_factory(args.model)()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--model {args.model!r} returned a {type(model).__name__}, not a torch.nn.Module")
    if args.weights:
        state = torch.load(args.weights, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
    if args.data:
        data = load_factory(args.data)()
    elif args.input_shape:
        if args.batches < 1:
            raise ValueError(f"--batches must be >= 1, got {args.batches}")
        torch.manual_seed(0)
        data = random_batches(model, args.input_shape, args.batches)
    else:
        raise ValueError("give --data package.module:factory (a list of [data, label] batches) or --input-shape")
    report = amct.auto_channel_prune_search(model, args.config, data, args.out, budget=args.budget)
    if args.chart:
        from openamct.search.chart import render_search_chart

        render_search_chart(report, args.chart)
    return json.dumps(report.as_dict(), indent=2) if args.json else format_search_report(report)
