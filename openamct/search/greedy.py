"""The search algorithm: which kept count each group takes so the budget is met.

``SearchAlgorithm`` is the base class users subclass (upstream's ``SearchChannelBase``, also
importable under that name from ``openamct.common.auto_channel_prune.search_channel_base``); ``GreedySearch``
(upstream's default) repeatedly takes the one step, over all searched groups, that loses the
least sensitivity per unit of budget gained (MACs or predicted milliseconds), until the budget
is met. A step removes one aligned block of channels (16 with ``ascend_optimized``), the least
sensitive ones still kept, from one group.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from openamct.search.named import resolve
from openamct.search.space import SearchSpace

logger = logging.getLogger(__name__)

__all__ = ["SearchAlgorithm", "GreedySearch", "SEARCH_ALGORITHMS", "resolve_search_alg"]

CostFn = Callable[[list[int]], float]  # kept count per group -> MACs or predicted ms (lower is better)


class SearchAlgorithm:
    """Base class: subclass it and implement ``search``."""

    def search(self, space: SearchSpace, cost: CostFn, target: float) -> list[int]:
        """Return one kept count per group of ``space.groups``, each one of that group's
        ``options`` (a fixed group has one), such that ``cost(kept) <= target``. Each group's
        ``costs[i]`` is the sensitivity lost at ``options[i]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement search")


class GreedySearch(SearchAlgorithm):
    """Steps in order of sensitivity lost per unit gained. Two refinements keep a coarse grid
    (16-channel steps) from overshooting the budget: once some step meets the budget, the least
    sensitive of those is the last one taken; then steps are given back, the most sensitive
    first, while the budget stays met."""

    def search(self, space: SearchSpace, cost: CostFn, target: float) -> list[int]:
        groups = [g for g in space.groups if not g.fixed and len(g.options) > 1]
        pos = {g.index: 0 for g in groups}
        kept = [g.options[0] for g in space.groups]
        current, steps = cost(kept), 0
        while current > target:
            cands = []
            for g in groups:
                i = pos[g.index] + 1
                if i >= len(g.options):
                    continue
                trial = list(kept)
                trial[g.index] = g.options[i]
                cands.append((g, cost(trial), g.costs[i] - g.costs[i - 1]))
            if not cands:
                raise ValueError(f"the budget cannot be met: every searched group is at its smallest "
                                 f"allowed size and the cost is {current:.4g} > {target:.4g}")
            finishing = [c for c in cands if c[1] <= target]
            if finishing:
                g, c, _ = min(finishing, key=lambda c: (c[2], c[1]))
            else:
                # A step that gains nothing (a latency table's plateau) is taken only when no
                # step gains anything, the cheapest first: it may open the way to one that does.
                g, c, _ = min(cands, key=lambda c: (c[2] / (current - c[1]) if current > c[1] else math.inf,
                                                     c[2] if current <= c[1] else -(current - c[1])))
            pos[g.index] += 1
            kept[g.index] = g.options[pos[g.index]]
            current, steps = c, steps + 1
        given = 0
        while True:
            back = []
            for g in groups:
                i = pos[g.index]
                if i == 0:
                    continue
                trial = list(kept)
                trial[g.index] = g.options[i - 1]
                c = cost(trial)
                if c <= target:
                    back.append((g.costs[i] - g.costs[i - 1], g, c))
            if not back:
                break
            _, g, current = max(back, key=lambda b: (b[0], -b[2]))
            pos[g.index] -= 1
            kept[g.index] = g.options[pos[g.index]]
            given += 1
        logger.info("greedy search: %d steps, %d given back, cost %.4g (target %.4g)", steps, given, current, target)
        return kept


SEARCH_ALGORITHMS = {"GreedySearch": GreedySearch}


def resolve_search_alg(search_alg: Any) -> SearchAlgorithm:
    return resolve("search_alg", search_alg, SearchAlgorithm, SEARCH_ALGORITHMS, "search", ("channel_prune_search",))
