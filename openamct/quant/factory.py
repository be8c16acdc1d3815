"""Build quantizer modules from plan specs (config values -> modules, one place)."""

from __future__ import annotations

from torch import nn

from openamct.config.specs import ActSpec, WtsSpec
from openamct.quant.quantizers import ActULQ, WeightARQ, WeightULQ


def make_act_quantizer(spec: ActSpec, fixed_min: bool, batch_num: int) -> ActULQ:
    if spec.clip_max is None:
        return ActULQ(fixed_min=fixed_min, batch_num=batch_num)
    return ActULQ(clip_max=spec.clip_max, clip_min=spec.clip_min, fixed_min=fixed_min, batch_num=batch_num)


def make_weight_quantizer(spec: WtsSpec, module: nn.Module) -> nn.Module:
    # The layout (axis, groups) is bound by CompressedLayer.wrap, which knows the weight shape.
    cls = WeightULQ if spec.algo == "ulq" else WeightARQ
    return cls(channel_wise=spec.channel_wise)
