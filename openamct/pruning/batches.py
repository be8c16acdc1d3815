"""Calibration data as the pruning family takes it: a list of model inputs, each a tensor, a dict
of tensors (keyword arguments, as a Hugging Face tokenizer returns them) or a tuple (positional
arguments). One place runs a batch and reads what the evaluators compare."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def as_batches(data, argument: str = "data") -> list:
    """``data`` as a list of batches: one tensor or dict is one batch; any other iterable is read
    once (a DataLoader gives its batches)."""
    if data is None:
        return []
    if torch.is_tensor(data) or isinstance(data, Mapping):
        return [data]
    try:
        batches = list(data)
    except TypeError:
        raise TypeError(f"{argument} must be a tensor, a dict of tensors or an iterable of them, "
                        f"got {type(data).__name__}") from None
    for i, b in enumerate(batches):
        if not (torch.is_tensor(b) or isinstance(b, (Mapping, tuple, list))):
            raise TypeError(f"{argument}[{i}] must be a tensor, a dict of tensors or a tuple of tensors, "
                            f"got {type(b).__name__}")
    return batches


def run(model, batch):
    """The model's output on one batch (dict: keyword arguments; tuple/list: positional)."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def main_tensor(out) -> torch.Tensor:
    """The tensor the default evaluator compares: ``logits`` where the output has them, else the
    last hidden state, else the output itself or its first element."""
    for attr in ("logits", "last_hidden_state"):
        t = getattr(out, attr, None)
        if torch.is_tensor(t):
            return t
    if torch.is_tensor(out):
        return out
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0]
    raise TypeError(f"cannot read a tensor from the model's output ({type(out).__name__}); pass evaluator=")


def first_tensor(batch) -> torch.Tensor:
    """A tensor of the batch (its device tells where the model runs)."""
    if torch.is_tensor(batch):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch
    for v in values:
        if torch.is_tensor(v):
            return v
    raise TypeError("a batch holds no tensor")
