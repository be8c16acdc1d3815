"""The table of pruning domains, by name. ``cnn`` is imported on first use only, so that the
dense and MoE domains (and ``import openamct``) never pay for the CNN graph analysis."""

from __future__ import annotations

import importlib

from openamct.pruning.domains.base import Domain, Unit

# name -> (module, class): resolved on first use
DOMAINS = {
    "cnn": ("openamct.pruning.domains.cnn", "CnnDomain"),
    "dense": ("openamct.pruning.domains.dense", "DenseDomain"),
    "moe": ("openamct.pruning.domains.moe", "MoeDomain"),
}


def get_domain(name: str) -> Domain:
    """A fresh domain object for ``name`` ("cnn", "dense" or "moe")."""
    if name not in DOMAINS:
        raise ValueError(f"unknown pruning domain {name!r}; known: {sorted(DOMAINS)}")
    module, cls = DOMAINS[name]
    return getattr(importlib.import_module(module), cls)()


__all__ = ["DOMAINS", "Domain", "Unit", "get_domain"]
