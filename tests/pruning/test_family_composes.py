"""A model pruned by amct.prune goes straight into create_compressed_retrain_model (2:4 + INT8)
and its deploy ONNX runs in ONNX Runtime, agreeing with the compressed PyTorch model."""

import numpy as np
import onnxruntime as ort
import torch
from prune_family_models import calib, tiny

import openamct as amct
from openamct.pruning import DENSE_LOWVAR_PRUNE_CFG

CFG = """
retrain_data_quant_config { ulq_quantize { dst_type: INT8 } }
retrain_weight_quant_config { arq_retrain { dst_type: INT8 channel_wise: true } }
prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 0 } } }
"""


def test_pruned_bert_into_24_int8_and_the_deploy_file_runs(tmp_path):
    model = tiny("bert")
    data = calib(kind="dict")
    amct.prune(model, DENSE_LOWVAR_PRUNE_CFG, data=data)
    assert model.config.intermediate_size == 32
    cfg = tmp_path / "c.cfg"
    cfg.write_text(CFG)
    sample = data[0]
    student = amct.create_compressed_retrain_model(model, sample, str(cfg), str(tmp_path / "r.txt"))
    inter = student.encoder.layer[0].output.dense
    w = inter.weight if hasattr(inter, "weight") else inter.layer.weight
    assert w.shape[1] == 32
    with torch.no_grad():
        for b in data:
            student.eval()(**b)  # the activation ranges, from the calibration batches
        ref = student(**sample).last_hidden_state.numpy()
    prefix = str(tmp_path / "pruned")
    amct.save_compressed_retrain_model(student, str(tmp_path / "r.txt"), prefix, sample,
                                       input_names=["input_ids", "attention_mask"], output_names=["hidden"])
    sess = ort.InferenceSession(prefix + "_deploy_model.onnx", providers=["CPUExecutionProvider"])
    got = sess.run(None, {k: v.numpy() for k, v in sample.items()})[0]
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos.min() > 0.98, cos.min()
