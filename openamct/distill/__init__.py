"""Upstream AMCT's distillation family: create_distill_config, create_distill_model, distill,
save_distill_model and DistillSampleBase (docs/distill.md)."""

from openamct.distill.api import (
    create_distill_config,
    create_distill_model,
    distill,
    save_distill_model,
)
from openamct.distill.distill_sample import DistillSampleBase

__all__ = ["create_distill_config", "create_distill_model", "distill", "save_distill_model", "DistillSampleBase"]
