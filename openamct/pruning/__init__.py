"""Upstream's one-call structured pruning family (``amct.prune``): in place, from calibration data.

``prune`` cuts dense FFN widths, CNN channels and MoE experts, by a fixed ratio or by searching
a tolerance, a size budget or a per-layer allocation; ``PruneReport`` says what it did.
"""

from openamct.pruning.api import prune
from openamct.pruning.diagnose import DiagnosisReport, prune_diagnose
from openamct.pruning.finetune import prune_finetune
from openamct.pruning.presets import (
    CNN_RECONSTRUCT_PRUNE_CFG,
    CNN_RECOVERY_MENU_CFG,
    CNN_VARIANCE_PRUNE_CFG,
    DENSE_LOWVAR_PRUNE_CFG,
    DENSE_RECOVERY_MENU_CFG,
    FULL_STRUCTURED_PRUNE_CFG,
    MOE_MASSVAR_PRUNE_CFG,
    MOE_OUTPUT_MERGE_PRUNE_CFG,
    MOE_VARIANCE_MENU_CFG,
    SENSITIVITY_ALLOC_PRUNE_CFG,
)
from openamct.pruning.report import PruneReport, StageEvent
from openamct.pruning.search import AutoTuneResult, TrialResult, accuracy_based_auto_prune

__all__ = [
    "prune", "PruneReport", "prune_finetune", "prune_diagnose", "accuracy_based_auto_prune",
    "CNN_RECONSTRUCT_PRUNE_CFG", "CNN_VARIANCE_PRUNE_CFG", "DENSE_LOWVAR_PRUNE_CFG", "FULL_STRUCTURED_PRUNE_CFG",
    "MOE_MASSVAR_PRUNE_CFG", "MOE_OUTPUT_MERGE_PRUNE_CFG", "SENSITIVITY_ALLOC_PRUNE_CFG",
]
# Upstream keeps these out of __all__ ("advanced"): importable by name, not by *.
_ADVANCED = (CNN_RECOVERY_MENU_CFG, DENSE_RECOVERY_MENU_CFG, MOE_VARIANCE_MENU_CFG, DiagnosisReport,
             StageEvent, AutoTuneResult, TrialResult)
