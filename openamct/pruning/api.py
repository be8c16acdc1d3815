"""``prune``: upstream's one call, in place. Fixed ratio by default; ``tolerance=`` searches the
largest ratio within a quality drop; ``size_budget=`` cuts to a share of the parameters; a config
with ``allocation.strategy="sensitivity"`` gives each unit its own ratio; a config with a ``menu``
tries each candidate on a copy and keeps the best."""

from __future__ import annotations

import logging

from torch import nn

from openamct.pruning import core
from openamct.pruning.batches import as_batches
from openamct.pruning.config import parse_config
from openamct.pruning.report import PruneReport

logger = logging.getLogger(__name__)


def check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def calibration(data, cfg, argument: str = "data") -> list:
    """The calibration batches; every method scores on data, so none is an error."""
    batches = as_batches(data, argument)
    if not batches:
        raise ValueError(f"{argument}= is required: every pruning method scores channels on calibration "
                         "data (a few batches of model inputs)")
    return batches


def prune_fixed(model, cfg, batches, report: PruneReport, ratios=None) -> PruneReport:
    """Each method in play at its own ratio (or ``ratios``: per unit name), applied in place."""
    report.backend = core.backend(model)
    report.params_before = core.count_params(model)
    targets = core.prepare(model, cfg, batches, report)
    keeps = [core.keep_masks(t, ratios if ratios is not None else t.spec.ratio) for t in targets]
    core.apply(model, targets, keeps, batches, report)
    report.params_after = core.count_params(model)
    return report


def _reject(**kwargs) -> None:
    given = sorted(k for k, v in kwargs.items() if v is not None)
    if given:
        raise ValueError(f"{', '.join(given)} only apply to a search mode: pass tolerance=, size_budget=, "
                         "or a config carrying a 'menu' or a sensitivity allocation")


def prune(model, config=None, data=None, batch_adapter=None, tolerance=None, evaluator=None,
          eval_iterations: int = 1, eval_data=None, ratio_grid=None, size_budget=None,
          finetune_fn=None, quant_fn=None, report: PruneReport | None = None) -> None:
    """Structured pruning of ``model`` in place (see docs/prune.md). Returns None; pass
    ``report=PruneReport()`` to read what was done."""
    from openamct.pruning import allocation, search

    check_model(model)
    if batch_adapter is not None:
        raise ValueError("batch_adapter is not supported: pass batches the model takes as they are "
                         "(a tensor, a dict of keyword arguments or a tuple of positional arguments)")
    if tolerance is not None and size_budget is not None:
        raise ValueError("pass only one of tolerance= and size_budget= (they are two search modes)")
    if report is not None and not isinstance(report, PruneReport):
        raise TypeError(f"report must be a PruneReport, got {type(report).__name__}")
    cfg = parse_config(config)
    batches = calibration(data, cfg)
    if eval_data is not None:
        eval_data = as_batches(eval_data, "eval_data")
    out = PruneReport()
    search_args = {"evaluator": evaluator, "eval_iterations": eval_iterations, "eval_data": eval_data,
                   "finetune_fn": finetune_fn, "quant_fn": quant_fn}
    if cfg.menu_domain and (tolerance is not None or size_budget is not None or ratio_grid is not None):
        raise ValueError("a config with a 'menu' picks among its candidates: tolerance=, size_budget= "
                         "and ratio_grid= do not apply")
    if tolerance is not None:
        search.tolerance_search(model, cfg, batches, tolerance, ratio_grid=ratio_grid, report=out,
                                apply=True, **search_args)
    elif size_budget is not None:
        search.size_budget_prune(model, cfg, batches, size_budget, ratio_grid=ratio_grid, report=out, **search_args)
    elif cfg.menu_domain:
        allocation.menu_prune(model, cfg, batches, report=out, **search_args)
    elif cfg.allocation and cfg.allocation["strategy"] == "sensitivity":
        _reject(ratio_grid=ratio_grid, finetune_fn=finetune_fn, quant_fn=quant_fn)
        allocation.sensitivity_prune(model, cfg, batches, report=out, evaluator=evaluator,
                                 eval_iterations=eval_iterations, eval_data=eval_data)
    else:
        _reject(evaluator=evaluator, eval_data=eval_data, ratio_grid=ratio_grid, finetune_fn=finetune_fn,
                quant_fn=quant_fn)
        prune_fixed(model, cfg, batches, out)
    if report is not None:
        report.copy_from(out)
