"""The registry: the techniques create and restore apply, in this order.

Order matters: channels are removed first (the model really shrinks), 2:4 then works on what
remains, and the quantizers go in last. A new technique is one module in this package with a
``Technique`` subclass (see ``base``) and one line here.
"""

from openamct.techniques.activation_quant import ActivationQuant
from openamct.techniques.base import Context, ExportParts, Technique
from openamct.techniques.filter_prune import FilterPruning
from openamct.techniques.quantization import Quantization
from openamct.techniques.sparsity24 import Sparsity24

TECHNIQUES: tuple[Technique, ...] = (
    FilterPruning(),
    Sparsity24(),
    Quantization(),
    ActivationQuant(),  # after Quantization: it follows the layers that one quantizes
)

__all__ = ["TECHNIQUES", "Context", "ExportParts", "Technique"]
