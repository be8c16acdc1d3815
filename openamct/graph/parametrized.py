"""Layers whose weight is computed by a parametrization (``torch.nn.utils.parametrize``:
``parametrizations.weight_norm``, ``spectral_norm``, orthogonal ...).

Their forward reads ``weight`` through the parametrization modules, so to the graph they look
like containers that call ``conv1d`` themselves. openamct compresses them with the
parametrization evaluated: on the working copy (never the caller's model) the weight becomes
the plain tensor the parametrization currently yields, and training then updates it directly.
Hook-based reparametrizations (the deprecated ``torch.nn.utils.weight_norm`` /
``spectral_norm``, which recompute ``weight`` in a forward pre-hook) are left float, with that
reason.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.utils import parametrize

from openamct.layer_types import layer_type_of

logger = logging.getLogger(__name__)


def evaluate_parametrizations(model: nn.Module) -> list[str]:
    """Replace weight parametrizations of supported layers by their value; return the layers."""
    done = []
    for name, module in list(model.named_modules()):
        if (parametrize.is_parametrized(module, "weight") and set(module.parametrizations) == {"weight"}
                and layer_type_of(module) is not None):
            kinds = ", ".join(type(p).__name__.lstrip("_") for p in module.parametrizations["weight"])
            _unparametrize(module)
            logger.info("layer %r: weight parametrization (%s) evaluated; it is compressed as a plain %s",
                        name, kinds, type(module).__name__)
            done.append(name)
    if done:
        logger.warning("%d layer(s) had a weight parametrization (e.g. weight_norm), compressed with it "
                       "evaluated: %s", len(done), ", ".join(done[:3]) + (" ..." if len(done) > 3 else ""))
    return done


@torch.no_grad()
def _unparametrize(module: nn.Module) -> None:
    """``remove_parametrizations`` without its side effect on the caller's model: torch deletes
    the property from the parametrized *class*, which a deep copy shares with the original.
    Here only this instance changes: back to its plain class, with the evaluated weight."""
    value = module.weight.detach().clone()
    requires_grad = module.parametrizations["weight"].original.requires_grad \
        if hasattr(module.parametrizations["weight"], "original") else True
    del module._modules["parametrizations"]
    module.__class__ = module.__class__.__bases__[0]
    module.register_parameter("weight", nn.Parameter(value, requires_grad=requires_grad))


def hook_reparametrized(module: nn.Module) -> str | None:
    """Why a layer whose weight a forward pre-hook recomputes must stay float, else None."""
    for hook in module._forward_pre_hooks.values():
        kind = type(hook).__name__
        if kind in ("WeightNorm", "SpectralNorm"):
            return (f"its weight is recomputed by a forward pre-hook ({kind}, the deprecated "
                    "torch.nn.utils API): use torch.nn.utils.parametrizations instead")
    return None
