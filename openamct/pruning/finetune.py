"""``prune_finetune``: a short plain training loop to recover a pruned model, in place.

The loss is the caller's ``loss_fn(model, batch)``, or with ``teacher=`` (the model before
pruning, say) the mean squared error between the two models' outputs (logits or last hidden
state), or upstream's defaults: a batch dict with ``labels`` uses the model's own loss, one with
``input_ids`` the language-model loss, an ``(inputs, labels)`` pair cross-entropy.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from openamct.pruning.batches import as_batches, main_tensor, run


def _to(batch, device):
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
    return type(batch)(v.to(device) if torch.is_tensor(v) else v for v in batch)


def _default_loss(model, batch, teacher):
    if teacher is not None:
        with torch.no_grad():
            ref = main_tensor(run(teacher, batch))
        return F.mse_loss(main_tensor(run(model, batch)), ref)
    if isinstance(batch, Mapping) and "labels" in batch:
        return model(**batch).loss
    if isinstance(batch, Mapping) and "input_ids" in batch:
        return model(**batch, labels=batch["input_ids"]).loss
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return F.cross_entropy(main_tensor(model(batch[0])), batch[1])
    raise ValueError("prune_finetune cannot derive a loss from these batches: pass loss_fn(model, batch) "
                     "or teacher= (the unpruned model)")


def prune_finetune(model, data, loss_fn=None, steps: int = 200, lr: float = 1e-4, weight_decay: float = 0.0,
                   warmup: int = 0, optimizer=None, batch_adapter=None, device=None, grad_clip: float | None = 1.0,
                   log_every: int = 0, teacher=None) -> dict:
    """Train ``model`` in place for ``steps`` steps over ``data`` (cycled), AdamW at ``lr`` with a
    linear warm-up. Returns steps run, first and last loss, and the loss history."""
    if batch_adapter is not None:
        raise ValueError("batch_adapter is not supported: pass batches the model takes as they are")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if steps == 0:
        return {"steps": 0, "initial_loss": None, "final_loss": None, "loss_history": []}
    batches = as_batches(data)
    if not batches:
        raise ValueError("prune_finetune needs at least one batch in data")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    device = device or params[0].device
    opt = optimizer or torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    was = model.training
    if teacher is not None:
        teacher.eval()
    model.train()
    history = []
    try:
        for i, batch in enumerate(itertools.islice(itertools.cycle(batches), steps)):
            if warmup > 0 and i < warmup:
                for g in opt.param_groups:
                    g["lr"] = lr * (i + 1) / warmup
            batch = _to(batch, device)
            loss = loss_fn(model, batch) if loss_fn is not None else _default_loss(model, batch, teacher)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            history.append(float(loss.detach()))
    finally:
        model.train(was)
        model.zero_grad(set_to_none=True)
    return {"steps": len(history), "initial_loss": history[0], "final_loss": history[-1],
            "loss_history": history if log_every <= 0 else history[::log_every]}
