"""Channel pruning + 2:4 sparsity + INT8 QAT with the AMCT compressed API, on scikit-learn's real
8x8 digits.

    python examples/compressed_retrain.py --epochs 10 --out runs/compressed

Flow: train FP32 -> create_compressed_retrain_model -> retrain, checkpoint -> (after an
interruption) restore_compressed_retrain_model -> retrain -> eval forward (records the INT8
scales) -> save_compressed_retrain_model -> run the fake-quant and deploy ONNX files.
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
    p.add_argument("--out", default="runs/compressed")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg, record = os.path.join(args.out, "compressed.cfg"), os.path.join(args.out, "record.txt")
    ckpt = os.path.join(args.out, "checkpoint.pth")
    with open(cfg, "w") as f:
        f.write(CONFIG)

    torch.manual_seed(0)
    data = load_digits()
    model = Net()
    train(model, data, args.epochs)
    model.eval()
    x = torch.randn(1, 1, 8, 8)  # only used to capture the graph

    compressed = amct.create_compressed_retrain_model(model, x, cfg, record)
    half = args.epochs // 2
    train(compressed, data, half, lr=1e-3)  # the first batch initialises the activation clips
    torch.save({"state_dict": compressed.state_dict()}, ckpt)
    del compressed  # pretend the job died here

    compressed = amct.restore_compressed_retrain_model(model, x, cfg, record, ckpt, "state_dict")
    train(compressed, data, args.epochs - half, lr=1e-3, first_epoch=half)
    accuracy = torch_accuracy(compressed, data)  # an eval forward: writes the scales to the record
    amct.save_compressed_retrain_model(compressed, record, os.path.join(args.out, "digits"), x,
                                       input_names=["input"], output_names=["logits"],
                                       dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})

    fake = onnx_accuracy(os.path.join(args.out, "digits_fake_quant_model.onnx"), data)
    deploy = onnx_accuracy(os.path.join(args.out, "digits_deploy_model.onnx"), data)
    print(f"FP32 accuracy {torch_accuracy(model, data):.4f}, compressed {accuracy:.4f}, "
          f"fake-quant ONNX {fake:.4f}, deploy ONNX {deploy:.4f}")


if __name__ == "__main__":
    main()
