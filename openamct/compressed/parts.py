"""What the techniques hand to a layer's wrapper: one typed field per kind of part."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class LayerParts:
    """The pieces one weight layer is compressed with.

    ``masks`` are weight masks of techniques beyond 2:4 (attribute name -> module with a
    ``mask`` buffer shaped like the weight and a ``forward(w)`` that may update it in
    training); they are applied after ``sparsity``, in insertion order."""

    bn: nn.Module | None = None  # a BatchNorm folded into the weights
    sparsity: nn.Module | None = None  # the 2:4 sparsifier
    masks: dict[str, nn.Module] = field(default_factory=dict)
    act_quant: nn.Module | None = None  # input activation quantizer (may be shared)
    wts_quant: nn.Module | None = None
    observe_output: bool = False  # keep an output range observer (deploy re-quantisation)
    out_quant: nn.Module | None = None  # output quantizer (activation_quant: the output feeds int8 ops)
    # the input arrives already quantized by act_quant itself (quant/residual.py): not applied twice
    input_on_grid: bool = False
