"""INT8 quantization-aware training with the AMCT QAT API, on scikit-learn's real 8x8 digits.

    python examples/quant_retrain.py --epochs 10 --out runs/quant

Flow: train FP32 -> create_quant_retrain_config (per-layer JSON) -> create_quant_retrain_model ->
retrain, checkpoint -> (after an interruption) restore_quant_retrain_model -> retrain -> eval
forward (records the scales) -> save_quant_retrain_model -> run the ONNX files.
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

# Optional: a retrain .cfg steering the generated JSON (here: keep the classifier in float).
# Without it, create_quant_retrain_config quantizes every supported layer with the defaults.
CONFIG = """
retrain_data_quant_config { ulq_quantize { } }
retrain_weight_quant_config { arq_retrain { channel_wise: true } }
quant_skip_layers: "head.2"
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
    p.add_argument("--out", default="runs/quant")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg, record = os.path.join(args.out, "quant.cfg"), os.path.join(args.out, "record.txt")
    config_file = os.path.join(args.out, "quant_config.json")
    ckpt = os.path.join(args.out, "checkpoint.pth")
    with open(cfg, "w") as f:
        f.write(CONFIG)

    torch.manual_seed(0)
    data = load_digits()
    model = DigitsNet()
    train(model, data, args.epochs)
    model.eval()
    x = torch.randn(1, 1, 8, 8)  # only used to capture the graph

    amct.create_quant_retrain_config(config_file, model, x, cfg)  # edit the JSON per layer if needed
    qat = amct.create_quant_retrain_model(config_file, model, record, x)
    half = args.epochs // 2
    train(qat, data, half, lr=1e-3)  # the first batch initialises the activation clips
    torch.save({"state_dict": qat.state_dict()}, ckpt)
    del qat  # pretend the job died here

    qat = amct.restore_quant_retrain_model(config_file, model, record, x, ckpt, "state_dict")
    train(qat, data, args.epochs - half, lr=1e-3, first_epoch=half)
    accuracy = torch_accuracy(qat, data)  # an eval forward: writes the scales to the record
    amct.save_quant_retrain_model(config_file, qat, record, os.path.join(args.out, "digits"), x,
                                  input_names=["input"], output_names=["logits"],
                                  dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})

    fake = onnx_accuracy(os.path.join(args.out, "digits_fake_quant_model.onnx"), data)
    deploy = onnx_accuracy(os.path.join(args.out, "digits_deploy_model.onnx"), data)
    print(f"FP32 accuracy {torch_accuracy(model, data):.4f}, QAT {accuracy:.4f}, "
          f"fake-quant ONNX {fake:.4f}, deploy ONNX {deploy:.4f}")


if __name__ == "__main__":
    main()
