"""auto_channel_prune_search: per-group filter-prune ratios for a MACs or latency budget.

Base classes users subclass: :class:`Sensitivity` (per-channel importance) and
:class:`SearchAlgorithm` (which kept count each group takes).
"""

from openamct.search.greedy import GreedySearch, SearchAlgorithm
from openamct.search.sensitivity import Sensitivity, TaylorLossSensitivity

__all__ = ["GreedySearch", "SearchAlgorithm", "Sensitivity", "TaylorLossSensitivity"]
