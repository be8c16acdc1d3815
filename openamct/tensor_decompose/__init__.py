"""Low-rank tensor decomposition of convolutions (upstream ``amct_pytorch.tensor_decompose``).

``auto_decomposition(model, decompose_info_path=None)`` splits each eligible Conv2d into two
convs and returns ``(model, changes)``; ``decompose_network(model, decompose_info_path)``
rebuilds that structure from the info file, for loading a checkpoint of the decomposed model.
Both return a copy: the caller's model is not changed. See docs/decomposition.md.
"""

from openamct.tensor_decompose.decompose import auto_decomposition, decompose_network

__all__ = ["auto_decomposition", "decompose_network"]
