"""How a candidate is measured: the caller's evaluator, or by default the top-1 agreement with the
original model's outputs on the evaluation batches; and, for allocation, a continuous distortion
(the relative squared error of the output against the original's)."""

from __future__ import annotations

import copy
import gc
import inspect
import logging

import torch

from openamct.pruning.batches import main_tensor, run
from openamct.pruning.domains._common import evaluating

logger = logging.getLogger(__name__)


def _outputs(model, batches) -> list[torch.Tensor]:
    with evaluating(model):
        return [main_tensor(run(model, b)).detach() for b in batches]


def fidelity(model, batches):
    """``quality(candidate)``: the share of positions whose top-1 (argmax over the last axis)
    matches the original's, read now."""
    if not batches:
        raise ValueError("the default evaluator needs data= or eval_data=; or pass evaluator=")
    refs = [o.argmax(-1) for o in _outputs(model, batches)]

    def quality(candidate) -> float:
        outs = _outputs(candidate, batches)
        agree = sum(int((o.argmax(-1) == r).sum()) for o, r in zip(outs, refs))
        return agree / max(1, sum(r.numel() for r in refs))

    return quality


def from_evaluator(evaluator, eval_iterations: int):
    """``quality(model)`` from a callable or an object with ``evaluate(model[, iterations])``."""
    if callable(evaluator) and not hasattr(evaluator, "evaluate"):
        fn = evaluator
    elif callable(getattr(evaluator, "evaluate", None)):
        try:
            params = inspect.signature(evaluator.evaluate).parameters
            takes_iterations = len(params) >= 2
        except (TypeError, ValueError):
            takes_iterations = False

        def fn(m):
            return evaluator.evaluate(m, eval_iterations) if takes_iterations else evaluator.evaluate(m)
    else:
        raise TypeError("evaluator must be a callable(model) -> float or have evaluate(model) -> float, "
                        f"got {type(evaluator).__name__}")

    def quality(m) -> float:
        value = fn(m)
        if value is None:
            raise TypeError("evaluator returned None: it must return a metric, higher is better")
        return float(value)

    return quality


def resolve(model, evaluator, eval_iterations, eval_batches):
    """(quality function, the original model's quality)."""
    if evaluator is not None:
        qf = from_evaluator(evaluator, eval_iterations)
        return qf, qf(model)
    return fidelity(model, eval_batches), 1.0


def distortion(model, batches):
    """``dist(candidate)``: sum over batches of ||out - ref||^2 / ||ref||^2 (0 = the original)."""
    refs = _outputs(model, batches)

    def dist(candidate) -> float:
        outs = _outputs(candidate, batches)
        return sum(float(((o - r) ** 2).sum() / (r ** 2).sum().clamp_min(1e-12)) for o, r in zip(outs, refs))

    return dist


def measure_copy(model, apply_fn, quality_fn, finetune_fn=None, quant_fn=None) -> float:
    """Quality of a pruned copy (for methods that rewrite weights, or when callbacks edit the
    model); any failure reads as unacceptable, so the search prunes less, not crashes."""
    trial = copy.deepcopy(model)
    try:
        apply_fn(trial)
        if finetune_fn is not None:
            finetune_fn(trial)
        if quant_fn is not None:
            got = quant_fn(trial)
            trial = got if isinstance(got, torch.nn.Module) else trial
        return quality_fn(trial)
    except Exception as e:  # noqa: BLE001 - a candidate that fails is a rejected candidate
        logger.warning("prune search: a candidate failed (%s: %s); it counts as unacceptable", type(e).__name__, e)
        return float("-inf")
    finally:
        del trial
        gc.collect()  # a model holds reference cycles: free the copy before the next one is made
