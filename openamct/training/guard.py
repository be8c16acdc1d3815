"""The bad-value guard: a NaN or inf in a training forward stops that forward, names where it
entered, and leaves the model as it was before it.

Cost in a steady step: one reduction over the model's outputs and one host read (the only
one a steady step makes: a GPU step is not held up per layer). Only when that read finds a
non-finite output does the guard look further: it runs the same batch again without
gradients, with a pre-hook on every quantized module, and names the first whose input,
activation clips or weight is not finite.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn


def _floats(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _floats(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _floats(v)]
    if hasattr(obj, "to_tuple"):  # Hugging Face ModelOutput
        return _floats(obj.to_tuple())
    return []


def outputs_finite(output: Any) -> bool:
    """One host read for all of ``output``'s float tensors: ``sum(t * 0)`` is 0 when every
    element is finite and NaN otherwise (inf * 0 is NaN), with nothing that can overflow. A meta
    tensor runs the same ops and has no value to read."""
    found = _floats(output)
    if not found:
        return True
    sums = [t.detach().mul(0).sum(dtype=torch.float32) for t in found]
    total = sums[0] if len(sums) == 1 else torch.stack([v.to(sums[0].device) for v in sums]).sum()
    return total.is_meta or float(total) == 0.0


def _bad(t: Any) -> int:
    return int((~torch.isfinite(t.detach())).sum()) if isinstance(t, Tensor) and t.is_floating_point() else 0


def _why(module: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why a bad value enters at ``module``, or None."""
    bad_in = sum(_bad(t) for t in _floats((args, kwargs)))
    if bad_in:
        return f"its input holds {bad_in} NaN/inf value(s)"
    for name, p in module.named_parameters():
        if _bad(p):
            what = "activation clips" if "clip" in name else "weight" if name.endswith("weight") else name
            return f"its {what} ({name}) hold NaN/inf after the last optimizer step (learning rate too high?)"
    return None


def locate(model: nn.Module, watched: dict[str, nn.Module], args: tuple, kwargs: dict) -> str:
    """Run the batch again (no gradients) and describe the first watched module a bad value
    reaches; the caller puts back what this forward changed."""
    found: list[str] = []

    def pre(name: str):
        def hook(module, a, kw):
            if not found:
                why = _why(module, a, kw)
                if why is not None:
                    found.append(f"layer {name!r}: {why}")
        return hook

    handles = [m.register_forward_pre_hook(pre(n), with_kwargs=True) for n, m in watched.items()]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception:  # the batch failed otherwise as well: what was found so far is the answer
        pass
    finally:
        for h in handles:
            h.remove()
    batch = sum(_bad(t) for t in _floats((args, kwargs)))
    where = found[0] if found else "no quantized layer's input or parameters (a float op of the model made it)"
    return f"{where}; the batch itself holds {batch} NaN/inf value(s)"
