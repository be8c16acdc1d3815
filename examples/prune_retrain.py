"""Channel pruning + 2:4 sparsity with the AMCT prune API, on scikit-learn's real 8x8 digits.

    python examples/prune_retrain.py --epochs 10 --out runs/prune

Flow: train FP32 -> create_prune_retrain_model -> retrain, checkpoint -> (after an interruption)
restore_prune_retrain_model -> retrain -> save_prune_retrain_model -> run the ONNX file.
With AMCT, only the import line differs (``import amct_pytorch as amct``).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.* importable

import openamct as amct  # noqa: E402
from examples.digits_flow import EXPORT_ARGS, onnx_accuracy, start, torch_accuracy, train  # noqa: E402

# conv2 loses half its output channels (and conv3 the matching inputs); the other conv and
# Linear layers get 2:4 sparsity. A layer takes either the override or the global pruning.
CONFIG = """
prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 0 } } }
override_layer_configs {
  layer_name: "conv2.0"
  prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 ascend_optimized: false } } }
}
"""


def main():
    s = start(__doc__.splitlines()[0], "runs/prune", "prune.cfg", CONFIG)
    cfg, record, ckpt, data, model, x = s.cfg, s.record, s.ckpt, s.data, s.model, s.x

    pruned = amct.create_prune_retrain_model(model, x, cfg, record)
    half = s.epochs // 2
    train(pruned, data, half, lr=1e-3)
    torch.save({"state_dict": pruned.state_dict()}, ckpt)
    del pruned  # pretend the job died here

    # Note the argument order: record_file before config_defination (as in AMCT).
    pruned = amct.restore_prune_retrain_model(model, x, record, cfg, ckpt, "state_dict")
    train(pruned, data, s.epochs - half, lr=1e-3, first_epoch=half)
    amct.save_prune_retrain_model(pruned, os.path.join(s.out, "digits"), x, **EXPORT_ARGS)

    fp32 = torch_accuracy(model, data)
    deploy = onnx_accuracy(os.path.join(s.out, "digits_deploy_model.onnx"), data)
    print(f"FP32 accuracy {fp32:.4f}, pruned deploy ONNX accuracy {deploy:.4f}")


if __name__ == "__main__":
    main()
