"""A small model compressed with all three techniques, trained a step and evaluated, with its
record and checkpoint in a folder: the starting point of the record and checkpoint value tests."""

import torch

import openamct as amct
from tests.small import INT8, NM, ConvFc, TwoConvFc, snapshot

CFG = """retrain_data_quant_config { ulq_quantize { } }
retrain_weight_quant_config { arq_retrain { } }
prune_config { n_out_of_m_pruner { l1_selective_prune { } } }
override_layer_configs { layer_name: "conv1" prune_config { filter_pruner {
  balanced_l2_norm_filter_prune { prune_ratio: 0.5 ascend_optimized: false } } } }
"""
X = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(0))


class Net(TwoConvFc):
    def __init__(self):
        super().__init__(c_in=4, width=16, outputs=4)


def compress_and_train(d) -> dict:
    """Writes d/c.cfg, d/rec.txt and d/ck.pth ({"sd": state_dict}); returns the state dict."""
    (d / "c.cfg").write_text(CFG)
    m = amct.create_compressed_retrain_model(Net(), X, str(d / "c.cfg"), str(d / "rec.txt"))
    m.train()
    m(X)
    m.eval()
    m(X)
    sd = snapshot(m)
    torch.save({"sd": sd}, d / "ck.pth")
    return sd


# A smaller one for the checkpoint and save tests: one conv (2:4, INT8) and a Linear head.
CONV_FC_CFG = INT8 + NM
CONV_FC_X = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(1))


class ConvFcNet(ConvFc):
    def __init__(self):
        super().__init__(c_in=8, width=16, outputs=4)
