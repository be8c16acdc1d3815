"""The registry: the techniques create and restore apply.

The order they run in is not this tuple's: ``order.ordered`` sorts it from each technique's
``after`` declaration (channels are removed first, so the model really shrinks; 2:4 and the
quantizers work on what remains; activation quantization follows the quantized layers). The
tuple's order only breaks ties, which keeps the record's entry order stable. A new technique is
one module with a ``Technique`` subclass (see ``base``) and one line here.
"""

from openamct.techniques.activation_quant import ActivationQuant
from openamct.techniques.base import Context, ExportParts, Technique
from openamct.techniques.filter_prune import FilterPruning
from openamct.techniques.matmul_quant import MatMulQuantization
from openamct.techniques.order import ordered, train_losses
from openamct.techniques.quantization import Quantization
from openamct.techniques.sparsity24 import Sparsity24

TECHNIQUES: tuple[Technique, ...] = ordered((
    FilterPruning(),
    Sparsity24(),
    Quantization(),
    ActivationQuant(),
    MatMulQuantization(),
))

__all__ = ["TECHNIQUES", "Context", "ExportParts", "Technique", "ordered", "train_losses"]
