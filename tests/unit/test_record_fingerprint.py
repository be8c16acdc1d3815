"""A record remembers which model it describes; restore refuses another
model's record naming the first difference, and upstream records (no fingerprint) still work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import openamct as amct
from openamct.record.file_io import read_record

CFG = ("prune_config { n_out_of_m_pruner { l1_selective_prune { } } }\n"
       "regular_prune_skip_layers: 'head'\n")
X = torch.randn(2, 8, 6, 6)


class Net(nn.Module):
    def __init__(self, head_kernel=3, head_type=nn.Conv2d):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.head = head_type(16, 16, head_kernel, padding=head_kernel // 2)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x))).mean(dim=(2, 3))


def _setup(tmp_path):
    (tmp_path / "c.cfg").write_text(CFG)
    m = amct.create_prune_retrain_model(Net(), X, str(tmp_path / "c.cfg"), str(tmp_path / "rec.txt"))
    m.train()
    m(X)
    torch.save({"sd": m.state_dict()}, tmp_path / "ck.pth")
    return str(tmp_path / "c.cfg"), str(tmp_path / "rec.txt"), str(tmp_path / "ck.pth")


def test_the_record_carries_the_fingerprint_and_stays_upstream_readable(tmp_path):
    _, rec, _ = _setup(tmp_path)
    text = open(rec).read()
    assert text.startswith("# openamct-fingerprint: ") and "# openamct-layer: head Conv2d 16x16x3x3\n" in text
    assert len(read_record(rec).prune_record) == 1  # the comment lines are skipped by the parser


@pytest.mark.parametrize("other,msg", [
    (lambda: Net(head_kernel=5), r"layer 'head' is Conv2d 16x16x3x3 in the record but Conv2d 16x16x5x5 in the model"),
    (lambda: Net(head_type=nn.ConvTranspose2d),
     r"layer 'head' is Conv2d 16x16x3x3 in the record but ConvTranspose2d 16x16x3x3 in the model"),
])
def test_another_models_record_is_refused_naming_the_first_difference(tmp_path, other, msg):
    cfg, rec, pth = _setup(tmp_path)
    with pytest.raises(ValueError, match=r"record_file '.*rec.txt' describes another model: " + msg):
        amct.restore_prune_retrain_model(other(), X, rec, cfg, pth, "sd")


def test_a_record_without_fingerprint_is_accepted_left_as_is_and_fingerprinted_at_the_next_write(tmp_path):
    cfg, rec, pth = _setup(tmp_path)
    fingerprinted = open(rec).read()
    bare = tmp_path / "bare.txt"
    bare.write_text("".join(ln for ln in fingerprinted.splitlines(keepends=True) if not ln.startswith("#")))
    upstream_text = bare.read_text()
    assert "# openamct" not in upstream_text

    restored = amct.restore_prune_retrain_model(Net(), X, str(bare), cfg, pth, "sd")
    # restore only reads the record: the user's upstream-style file is not rewritten
    assert bare.read_text() == upstream_text
    reference = amct.restore_prune_retrain_model(Net(), X, rec, cfg, pth, "sd")
    restored.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(restored(X), reference(X))
    assert torch.equal(restored.state_dict()["conv.sparsity.mask_bits"],
                       torch.load(pth)["sd"]["conv.sparsity.mask_bits"])

    # the restored model's next record write adds the fingerprint of the model it was given:
    # the same header create wrote, above the same entries
    amct.save_prune_retrain_model(restored, str(tmp_path / "out"), X)
    assert bare.read_text() == fingerprinted
