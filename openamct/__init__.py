"""openamct: AMCT-compatible retrain compression for PyTorch with standard ONNX output.

``import openamct as amct`` gives the upstream ``amct_pytorch`` retrain API.
"""

import logging

from openamct.api import (
    auto_channel_prune_search,
    convert_qat_model,
    create_compressed_retrain_model,
    create_prune_retrain_model,
    create_quant_retrain_config,
    create_quant_retrain_model,
    dynamic_quantize_lstm,
    restore_compressed_retrain_model,
    restore_prune_retrain_model,
    restore_quant_retrain_model,
    save_compressed_retrain_model,
    save_prune_retrain_model,
    save_quant_retrain_model,
)
from openamct.distill import (
    DistillSampleBase,
    create_distill_config,
    create_distill_model,
    distill,
    save_distill_model,
)
from openamct.pruning import (
    PruneReport,
    accuracy_based_auto_prune,
    prune,
    prune_diagnose,
    prune_finetune,
)
from openamct.tensor_decompose import auto_decomposition, decompose_network

__version__ = "0.1.0"

__all__ = [
    "create_prune_retrain_model", "restore_prune_retrain_model", "save_prune_retrain_model",
    "create_compressed_retrain_model", "restore_compressed_retrain_model", "save_compressed_retrain_model",
    "create_quant_retrain_config", "create_quant_retrain_model", "restore_quant_retrain_model",
    "save_quant_retrain_model", "auto_channel_prune_search", "auto_decomposition", "decompose_network",
    "convert_qat_model", "dynamic_quantize_lstm",
    "create_distill_config", "create_distill_model", "distill", "save_distill_model", "DistillSampleBase",
    "prune", "PruneReport", "prune_finetune", "prune_diagnose", "accuracy_based_auto_prune",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
