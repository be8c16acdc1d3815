"""INT8 quantization-aware training with the AMCT QAT API, on scikit-learn's real 8x8 digits.

    python examples/quant_retrain.py --epochs 10 --out runs/quant

Flow: train FP32 -> create_quant_retrain_config (per-layer JSON) -> create_quant_retrain_model ->
retrain, checkpoint -> (after an interruption) restore_quant_retrain_model -> retrain -> eval
forward (records the scales) -> save_quant_retrain_model -> run the ONNX files.
With AMCT, only the import line differs (``import amct_pytorch as amct``).
"""

import argparse
import os

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

import openamct as amct
from openamct.demo.data import batches, load_digits

# Optional: a retrain .cfg steering the generated JSON (here: keep the classifier in float).
# Without it, create_quant_retrain_config quantizes every supported layer with the defaults.
CONFIG = """
retrain_data_quant_config { ulq_quantize { } }
retrain_weight_quant_config { arq_retrain { channel_wise: true } }
quant_skip_layers: "head.2"
"""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.conv3(self.pool(self.conv2(self.conv1(x)))))


def train(model, data, epochs, lr=3e-3, first_epoch=0):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for epoch in range(first_epoch, first_epoch + epochs):
        for xb, yb in batches(data.x_train, data.y_train, 32, shuffle=True, seed=epoch):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()


def torch_accuracy(model, data):
    with torch.no_grad():
        return float((model.eval()(data.x_test).argmax(1) == data.y_test).float().mean())


def onnx_accuracy(path, data):
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    logits = sess.run(None, {sess.get_inputs()[0].name: data.x_test.numpy()})[0]
    return float(np.mean(logits.argmax(1) == data.y_test.numpy()))


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
    model = Net()
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
