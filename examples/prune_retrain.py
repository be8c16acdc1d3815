"""Channel pruning + 2:4 sparsity with the AMCT prune API, on scikit-learn's real 8x8 digits.

    python examples/prune_retrain.py --epochs 10 --out runs/prune

Flow: train FP32 -> create_prune_retrain_model -> retrain, checkpoint -> (after an interruption)
restore_prune_retrain_model -> retrain -> save_prune_retrain_model -> run the ONNX file.
With AMCT, only the import line differs (``import amct_pytorch as amct``).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.* importable

import openamct as amct  # noqa: E402
from examples.digits import DigitsNet, load_digits  # noqa: E402
from openamct.demo import bench  # noqa: E402
from openamct.demo.train import evaluate, train_epochs  # noqa: E402

# conv2 loses half its output channels (and conv3 the matching inputs); the other conv and
# Linear layers get 2:4 sparsity. A layer takes either the override or the global pruning.
CONFIG = """
prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 0 } } }
override_layer_configs {
  layer_name: "conv2.0"
  prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 ascend_optimized: false } } }
}
"""


def train(model, data, epochs, lr=3e-3, first_epoch=0):
    # Constant lr, epoch e shuffled with seed e: a resumed run sees what an uninterrupted one would.
    train_epochs(model, data.x_train, data.y_train, epochs, batch_size=32, lr=lr, seed=first_epoch,
                 scheduler=None, progress=False)


def torch_accuracy(model, data):
    return evaluate(model, data.x_test, data.y_test)


def onnx_accuracy(path, data):
    return bench.onnx_accuracy(bench.session(path), data.x_test, data.y_test)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10, help="FP32 epochs; retraining uses as many")
    p.add_argument("--out", default="runs/prune")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg, record = os.path.join(args.out, "prune.cfg"), os.path.join(args.out, "record.txt")
    ckpt = os.path.join(args.out, "checkpoint.pth")
    with open(cfg, "w") as f:
        f.write(CONFIG)

    torch.manual_seed(0)
    data = load_digits()
    model = DigitsNet()
    train(model, data, args.epochs)
    model.eval()
    x = torch.randn(1, 1, 8, 8)  # only used to capture the graph

    pruned = amct.create_prune_retrain_model(model, x, cfg, record)
    half = args.epochs // 2
    train(pruned, data, half, lr=1e-3)
    torch.save({"state_dict": pruned.state_dict()}, ckpt)
    del pruned  # pretend the job died here

    # Note the argument order: record_file before config_defination (as in AMCT).
    pruned = amct.restore_prune_retrain_model(model, x, record, cfg, ckpt, "state_dict")
    train(pruned, data, args.epochs - half, lr=1e-3, first_epoch=half)
    amct.save_prune_retrain_model(pruned, os.path.join(args.out, "digits"), x,
                                  input_names=["input"], output_names=["logits"],
                                  dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})

    fp32 = torch_accuracy(model, data)
    deploy = onnx_accuracy(os.path.join(args.out, "digits_deploy_model.onnx"), data)
    print(f"FP32 accuracy {fp32:.4f}, pruned deploy ONNX accuracy {deploy:.4f}")


if __name__ == "__main__":
    main()
