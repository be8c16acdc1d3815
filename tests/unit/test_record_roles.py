"""One module may hold several record entries of one technique, one per role: Hugging Face
MobileViT's stem SiLU is wrapped with its own quantizers and its output, read by a quantized
layer and a residual Add, is quantized by a hook as well. Restore accepts the record create
wrote, and still refuses a true repeat (same technique, role and module)."""

from __future__ import annotations

import pytest
import torch

import openamct as amct
from openamct.record.file_io import parse_record_text, record_to_text

CFG = ("retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
       "prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 } } }\n")
STEM = "mobilevit.conv_stem.activation"


def _model():
    from transformers import MobileViTConfig, MobileViTForImageClassification

    torch.manual_seed(0)
    cfg = MobileViTConfig(image_size=32, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[16, 16, 24, 32, 48, 64, 96],
                          num_labels=10)
    return MobileViTForImageClassification(cfg).eval()


def test_a_module_with_two_roles_restores(tmp_path):
    (tmp_path / "c.cfg").write_text(CFG)
    x = {"pixel_values": torch.randn(2, 3, 32, 32)}
    m = amct.create_compressed_retrain_model(_model(), x, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"))
    m.train()
    m(**x)
    m.eval()
    with torch.no_grad():
        want = m(**x).logits
    torch.save(m.state_dict(), tmp_path / "ck.pth")
    m._openamct.flush()
    record = parse_record_text((tmp_path / "r.txt").read_text())
    roles = [next(a.s for a in pr.selective_prune.attr if a.name == "op") for pr in record.prune_record
             if pr.selective_prune.name == STEM]
    assert sorted(roles) == [b"residual", b"silu"]  # the case this test is about
    r = amct.restore_compressed_retrain_model(_model(), x, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"),
                                              str(tmp_path / "ck.pth"))
    r.eval()
    with torch.no_grad():
        assert torch.equal(r(**x).logits, want)
    # a true repeat: the same role of the same module twice
    twice = next(pr for pr in record.prune_record if pr.selective_prune.name == STEM)
    record.prune_record.add().CopyFrom(twice)
    (tmp_path / "bad.txt").write_text(record_to_text(record))
    with pytest.raises(ValueError, match=rf"selective_prune \w+ '{STEM}'\) repeats the entry of prune_record"):
        amct.restore_compressed_retrain_model(_model(), x, str(tmp_path / "c.cfg"), str(tmp_path / "bad.txt"),
                                              str(tmp_path / "ck.pth"))
