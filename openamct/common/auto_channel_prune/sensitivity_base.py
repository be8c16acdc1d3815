"""``SensitivityBase`` at upstream's path: openamct's ``openamct.search.Sensitivity``.

Subclass it and implement ``channel_scores(model, batches, groups)`` (docs/prune_search.md).
Upstream's hooks, ``setup_initialization`` and ``get_sensitivity(search_records)``, read AMCT's
internal graph and record objects, which openamct does not have: a subclass implementing only
those is refused with that reason when the search starts.
"""

from openamct.search.sensitivity import Sensitivity as SensitivityBase
from openamct.search.sensitivity import TaylorLossSensitivity

__all__ = ["SensitivityBase", "TaylorLossSensitivity"]
