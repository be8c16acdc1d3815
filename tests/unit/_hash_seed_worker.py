"""Worker for ``test_hash_seed``: one create -> train -> save -> restore run, every file it writes
put in OUTDIR. Run as ``python tests/unit/_hash_seed_worker.py OUTDIR`` under a chosen
PYTHONHASHSEED; the test compares what two seeds wrote.

The config mixes all three techniques (filter pruning, 2:4 on several layers, INT8) so that
every ordering the record and the ONNX files could take from a set or dict shows up.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import openamct as amct  # noqa: E402
from tests.models import MODELS, example_input  # noqa: E402
from tests.training import sgd_steps  # noqa: E402

NM_LAYERS = ["features.1.conv.6", "features.2.conv.6", "features.3.conv.6", "features.4.0", "classifier"]
CONFIG = ("prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.3 "
          "ascend_optimized: false } } }\n"
          + "".join(f'override_layer_configs {{ layer_name: "{n}" prune_config {{ n_out_of_m_pruner {{ '
                    'l1_selective_prune { update_freq: 0 } } } }\n' for n in NM_LAYERS)
          + "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n")


def main(out: str) -> None:
    torch.set_num_threads(1)  # the two runs compared must do the same float arithmetic
    torch.manual_seed(0)
    name = "MobileNetV2Tiny"
    x = example_input(name)
    batch = torch.cat([example_input(name, seed=s) for s in range(8)])
    cfg, rec, ck = (os.path.join(out, f) for f in ("c.cfg", "record.txt", "ck.pth"))
    with open(cfg, "w") as f:
        f.write(CONFIG)
    model = amct.create_compressed_retrain_model(MODELS[name](), x, cfg, rec)
    sgd_steps(model, batch, steps=2)
    model.eval()
    with torch.no_grad():
        model(batch)  # eval after training: the record gets the scales
    torch.save({"state_dict": model.state_dict()}, ck)
    amct.save_compressed_retrain_model(model, rec, os.path.join(out, "m"), x)
    restored = amct.restore_compressed_retrain_model(MODELS[name](), x, cfg, rec, ck, "state_dict")
    # save writes the record it is given: the restored model's goes to a file of its own
    amct.save_compressed_retrain_model(restored, os.path.join(out, "restored_record.txt"), os.path.join(out, "r"), x)


if __name__ == "__main__":
    main(sys.argv[1])
