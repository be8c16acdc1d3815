"""A small model compressed with all three techniques, trained a step and evaluated, with its
record and checkpoint in a folder: the starting point of the record and checkpoint value tests."""

import torch
from torch import nn

import openamct as amct

CFG = """retrain_data_quant_config { ulq_quantize { } }
retrain_weight_quant_config { arq_retrain { } }
prune_config { n_out_of_m_pruner { l1_selective_prune { } } }
override_layer_configs { layer_name: "conv1" prune_config { filter_pruner {
  balanced_l2_norm_filter_prune { prune_ratio: 0.5 ascend_optimized: false } } } }
"""
X = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(0))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv2(torch.relu(self.conv1(x)))).mean(dim=(2, 3)))


def compress_and_train(d) -> dict:
    """Writes d/c.cfg, d/rec.txt and d/ck.pth ({"sd": state_dict}); returns the state dict."""
    (d / "c.cfg").write_text(CFG)
    m = amct.create_compressed_retrain_model(Net(), X, str(d / "c.cfg"), str(d / "rec.txt"))
    m.train()
    m(X)
    m.eval()
    m(X)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    torch.save({"sd": sd}, d / "ck.pth")
    return sd


# A smaller one for the checkpoint and save tests: one conv (2:4, INT8) and a Linear head.
CONV_FC_CFG = ("retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
               "prune_config { n_out_of_m_pruner { l1_selective_prune { } } }\n")
CONV_FC_X = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(1))


class ConvFcNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))
