"""INT8 quantization-aware training with the AMCT QAT API, on scikit-learn's real 8x8 digits.

    python examples/quant_retrain.py --epochs 10 --out runs/quant

Flow: train FP32 -> create_quant_retrain_config (per-layer JSON) -> create_quant_retrain_model ->
retrain, checkpoint -> (after an interruption) restore_quant_retrain_model -> retrain -> eval
forward (records the scales) -> save_quant_retrain_model -> run the ONNX files.
With AMCT, only the import line differs (``import amct_pytorch as amct``).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.* importable

import openamct as amct  # noqa: E402
from examples.digits_flow import EXPORT_ARGS, onnx_accuracy, start, torch_accuracy, train  # noqa: E402

# Optional: a retrain .cfg steering the generated JSON (here: keep the classifier in float).
# Without it, create_quant_retrain_config quantizes every supported layer with the defaults.
CONFIG = """
retrain_data_quant_config { ulq_quantize { } }
retrain_weight_quant_config { arq_retrain { channel_wise: true } }
quant_skip_layers: "head.2"
"""


def main():
    s = start(__doc__.splitlines()[0], "runs/quant", "quant.cfg", CONFIG)
    cfg, record, ckpt, data, model, x = s.cfg, s.record, s.ckpt, s.data, s.model, s.x
    config_file = os.path.join(s.out, "quant_config.json")

    amct.create_quant_retrain_config(config_file, model, x, cfg)  # edit the JSON per layer if needed
    qat = amct.create_quant_retrain_model(config_file, model, record, x)
    half = s.epochs // 2
    train(qat, data, half, lr=1e-3)  # the first batch initialises the activation clips
    torch.save({"state_dict": qat.state_dict()}, ckpt)
    del qat  # pretend the job died here

    qat = amct.restore_quant_retrain_model(config_file, model, record, x, ckpt, "state_dict")
    train(qat, data, s.epochs - half, lr=1e-3, first_epoch=half)
    accuracy = torch_accuracy(qat, data)  # an eval forward: writes the scales to the record
    amct.save_quant_retrain_model(config_file, qat, record, os.path.join(s.out, "digits"), x, **EXPORT_ARGS)

    fake = onnx_accuracy(os.path.join(s.out, "digits_fake_quant_model.onnx"), data)
    deploy = onnx_accuracy(os.path.join(s.out, "digits_deploy_model.onnx"), data)
    print(f"FP32 accuracy {torch_accuracy(model, data):.4f}, QAT {accuracy:.4f}, "
          f"fake-quant ONNX {fake:.4f}, deploy ONNX {deploy:.4f}")


if __name__ == "__main__":
    main()
