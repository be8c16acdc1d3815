"""Filter pruning through a fused projection: GPT-2's ``c_attn(x).split(split_size,
dim=2)`` into Q, K and V. The same heads leave all three pieces of c_attn's output rows, c_proj's
input columns follow, ``split_size`` follows the kept width; recorded and replayed exactly; a
split whose size nothing holds is refused naming the module."""

import copy

import pytest
import torch
from torch import nn

from openamct.record import attrs
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.sparsity.filter import apply_removal
from openamct.sparsity.filter_record import groups_from_records, groups_to_records
from tests.unit.test_heads import heads_group, prune
from tests.zoo.families import build

ATTN = "transformer.h.0.attn"


def test_gpt2_c_attn_loses_the_same_heads_in_q_k_and_v():
    original, inputs = build("GPT-2")  # 4 heads of 8, n_embd 32: c_attn has 96 output rows
    model = copy.deepcopy(original)
    groups, _ = prune(model, inputs, ratio=0.5)
    g = heads_group(groups, f"{ATTN}.c_attn")
    assert [(p.name, p.begin, p.end, p.repeat) for p in g.producers] == [
        (f"{ATTN}.c_attn", 32 * i, 32 * (i + 1), 8) for i in range(3)]
    assert [(c.name, c.begin, c.end, c.repeat) for c in g.consumers] == [(f"{ATTN}.c_proj", 0, 32, 8)]
    assert {m.name for m in g.passive if m.op_type == "Attribute"} == {f"{ATTN}.split_size"}
    assert len(g.removed) == 2
    w = model.transformer.h[0].attn.c_attn.weight.detach().clone()  # Conv1D: [in, out]
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    apply_removal(model, groups)
    att = model.transformer.h[0].attn
    keep = [p * 32 + r for p in range(3) for r in range(32) if r // 8 not in g.removed]
    assert att.c_attn.weight.shape == (32, 48) and torch.equal(att.c_attn.weight, w[:, keep])
    assert (att.c_attn.nf, att.c_proj.nx, att.c_proj.weight.shape[0], att.split_size) == (48, 16, 16, 16)
    with torch.no_grad():
        out = model(**inputs).logits
    assert out.shape == (*inputs["input_ids"].shape, 100)
    fresh = copy.deepcopy(original)
    apply_removal(fresh, groups_from_records(record, fresh))
    with torch.no_grad():
        assert torch.equal(fresh(**inputs).logits, out)


def test_a_record_slicing_only_part_of_a_fused_layer_is_refused():
    original, inputs = build("GPT-2")
    groups, _ = prune(copy.deepcopy(original), inputs, ratio=0.5)
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    pr = next(pr for pr in record.prune_record if pr.producer[0].name == f"{ATTN}.c_attn")
    del pr.producer[2]  # V's piece left out: its rows would stay while c_proj loses columns
    with pytest.raises(ValueError, match=rf"producer '{ATTN}.c_attn' has 96 output channels, its record slices "
                                         r"\[\(0, 32\), \(32, 64\)\] do not cover them"):
        groups_from_records(record, copy.deepcopy(original))
    assert attrs.get_int(pr.producer[1], "begin") == 32


class LiteralSplit(nn.Module):
    """A fused projection split by a size nothing on the module holds."""

    def __init__(self, chunk=False):
        super().__init__()
        self.qkv, self.o, self.chunk = nn.Linear(16, 48), nn.Linear(16, 4), chunk

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, -1, 8).transpose(1, 2) for t in (  # 2 heads of 8 in each piece
            self.qkv(x).chunk(3, dim=-1) if self.chunk else self.qkv(x).split(16, dim=-1)))
        ctx = (torch.softmax(q @ k.transpose(-1, -2), -1) @ v).transpose(1, 2).reshape(b, n, -1)
        return self.o(ctx).mean(1)


def test_a_split_size_written_out_without_attribute_is_refused():
    _, blocked = prune(LiteralSplit().eval(), torch.randn(2, 5, 16))
    b = next(b for b in blocked if "qkv" in b.producers)
    assert b.at.startswith("split_") and "has no attribute split_size = 16 to update" in b.reason


def test_chunk_needs_no_attribute_and_the_pieces_go_together():
    torch.manual_seed(0)
    model, x = LiteralSplit(chunk=True).eval(), torch.randn(2, 5, 16)
    groups, _ = prune(model, x, ratio=0.5)
    g = heads_group(groups, "qkv")
    assert [(p.begin, p.end, p.repeat) for p in g.producers] == [(0, 16, 8), (16, 32, 8), (32, 48, 8)]
    assert len(g.removed) == 1  # one head of 8 rows in each of Q, K and V
    apply_removal(model, groups)
    assert model.qkv.out_features == 24 and model.o.in_features == 8
    assert model(x).shape == (2, 4)
