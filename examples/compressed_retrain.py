"""Channel pruning + 2:4 sparsity + INT8 QAT with the AMCT compressed API, on scikit-learn's real
8x8 digits.

    python examples/compressed_retrain.py --epochs 10 --out runs/compressed

Flow: train FP32 -> create_compressed_retrain_model -> retrain, checkpoint -> (after an
interruption) restore_compressed_retrain_model -> retrain -> eval forward (records the INT8
scales) -> save_compressed_retrain_model -> run the fake-quant and deploy ONNX files.
With AMCT, only the import line differs (``import amct_pytorch as amct``).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.* importable

import openamct as amct  # noqa: E402
from examples.digits_flow import EXPORT_ARGS, onnx_accuracy, start, torch_accuracy, train  # noqa: E402

# INT8 activations (learned clips) and per-channel INT8 weights everywhere; conv2 loses half its
# output channels, the other layers get 2:4 sparsity (a layer takes the override or the global).
CONFIG = """
retrain_data_quant_config { ulq_quantize { } }
retrain_weight_quant_config { arq_retrain { channel_wise: true } }
prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 0 } } }
override_layer_configs {
  layer_name: "conv2.0"
  prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 ascend_optimized: false } } }
}
"""


def main():
    s = start(__doc__.splitlines()[0], "runs/compressed", "compressed.cfg", CONFIG)
    cfg, record, ckpt, data, model, x = s.cfg, s.record, s.ckpt, s.data, s.model, s.x

    compressed = amct.create_compressed_retrain_model(model, x, cfg, record)
    half = s.epochs // 2
    train(compressed, data, half, lr=1e-3)  # the first batch initialises the activation clips
    torch.save({"state_dict": compressed.state_dict()}, ckpt)
    del compressed  # pretend the job died here

    compressed = amct.restore_compressed_retrain_model(model, x, cfg, record, ckpt, "state_dict")
    train(compressed, data, s.epochs - half, lr=1e-3, first_epoch=half)
    accuracy = torch_accuracy(compressed, data)  # an eval forward: writes the scales to the record
    amct.save_compressed_retrain_model(compressed, record, os.path.join(s.out, "digits"), x, **EXPORT_ARGS)

    fake = onnx_accuracy(os.path.join(s.out, "digits_fake_quant_model.onnx"), data)
    deploy = onnx_accuracy(os.path.join(s.out, "digits_deploy_model.onnx"), data)
    print(f"FP32 accuracy {torch_accuracy(model, data):.4f}, compressed {accuracy:.4f}, "
          f"fake-quant ONNX {fake:.4f}, deploy ONNX {deploy:.4f}")


if __name__ == "__main__":
    main()
