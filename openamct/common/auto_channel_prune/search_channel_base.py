"""``SearchChannelBase`` and ``GreedySearch`` at upstream's path: openamct's
``openamct.search.SearchAlgorithm`` and ``GreedySearch``.

Subclass it and implement ``search(space, cost, target)`` (docs/prune_search.md). Upstream's
hook, ``channel_prune_search(graph_info, search_records, prune_config)``, reads AMCT's internal
graph and record objects, which openamct does not have: a subclass implementing only that is
refused with that reason when the search starts.
"""

from openamct.search.greedy import GreedySearch
from openamct.search.greedy import SearchAlgorithm as SearchChannelBase

__all__ = ["SearchChannelBase", "GreedySearch"]
