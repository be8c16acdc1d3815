"""timm's Attention: ``qkv(x).reshape(B, N, 3, self.num_heads, head_dim)`` splits one fused
projection into Q, K, V and heads in one reshape, ``scaled_dot_product_attention`` (or Q·Kᵀ,
softmax·V) couples them, ``reshape(B, N, self.attn_dim)`` merges the heads. Whole heads are
pruned from Q, K and V alike, and ``num_heads`` / ``attn_dim`` follow."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.sparsity.consistency import consistent_groups
from openamct.sparsity.filter import apply_removal
from openamct.sparsity.filter_record import groups_from_records, groups_to_records
from tests.pruning import select_filters

TOKENS = torch.randn(2, 5, 8)


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4, fused=True, merge="attn_dim", heads_attr=True):
        super().__init__()
        if heads_attr:
            self.num_heads = heads
        if merge == "attn_dim":
            self.attn_dim = dim
        self.heads, self.head_dim, self.fused = heads, dim // heads, fused
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        heads = self.num_heads if hasattr(self, "num_heads") else self.heads
        q, k, v = self.qkv(x).reshape(B, N, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.fused:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            x = (q @ k.transpose(-2, -1) * self.head_dim ** -0.5).softmax(-1) @ v
        return self.proj(x.transpose(1, 2).reshape(B, N, getattr(self, "attn_dim", C)))


class Net(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.embed, self.attn = nn.Linear(8, 32), Attention(**kw)

    def forward(self, x):
        return self.attn(self.embed(x)).mean(1)


def prune(model, ratio=0.5):
    return select_filters(model, TOKENS, ratio, types=None)


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "matmul"])
def test_fused_qkv_loses_whole_heads_from_q_k_and_v(fused):
    torch.manual_seed(0)
    original = Net(fused=fused).eval()
    model = copy.deepcopy(original)
    groups, _ = prune(model)
    (g,) = [g for g in groups if g.producer_names[0] == "attn.qkv"]
    assert [(m.name, m.begin, m.end, m.repeat) for m in g.producers] == [
        ("attn.qkv", 0, 32, 8), ("attn.qkv", 32, 64, 8), ("attn.qkv", 64, 96, 8)]
    assert {m.name for m in g.passive if m.op_type == "Attribute"} == {"attn.num_heads", "attn.attn_dim"}
    assert [m.name for m in g.consumers] == ["attn.proj"] and g.channels == 4 and len(g.removed) == 2
    record = ScaleOffsetRecord()
    groups_to_records([g], record)
    apply_removal(model, [g])
    assert (model.attn.num_heads, model.attn.attn_dim, model.attn.qkv.out_features) == (2, 16, 48)
    # heads are independent: the pruned model is the original with the removed heads' proj columns zeroed
    cols = [h * 8 + j for h in g.removed for j in range(8)]
    with torch.no_grad():
        original.attn.proj.weight[:, cols] = 0
        assert torch.allclose(model(TOKENS), original(TOKENS), atol=1e-5)
    fresh = copy.deepcopy(Net(fused=fused).eval())
    apply_removal(fresh, groups_from_records(record, fresh))
    assert (fresh.attn.num_heads, fresh.attn.attn_dim, fresh.attn.qkv.out_features) == (2, 16, 48)


def test_merge_with_the_input_width_stays_whole(caplog):  # metaformer's Attention: reshape(B, N, C)
    # C (the input's width) equals num_heads * head_dim as GPT-Neo's merge does, so the graph cannot
    # tell them apart: the analysis proposes the heads, and the pruned forward refuses them
    model = Net(merge="C").eval()
    groups, _ = prune(model)
    heads = [g for g in groups if g.producer_names[0] == "attn.qkv"]
    assert heads and heads[0].removed
    before = [p.detach().clone() for p in model.parameters()]
    assert consistent_groups(model, heads, TOKENS) == []
    assert "RuntimeError" in caplog.text and "attn.qkv" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert model.attn.num_heads == 4


def test_merge_with_a_literal_width_and_no_head_attribute_blocks():
    groups, blocked = prune(Net(merge="C", heads_attr=False).eval())
    assert not [g for g in groups if g.producer_names[0] == "attn.qkv"]
    assert [b for b in blocked if b.producers[0] == "attn.qkv"]


def test_head_count_without_an_attribute_blocks():
    groups, blocked = prune(Net(heads_attr=False).eval())
    assert not [g for g in groups if g.producer_names[0] == "attn.qkv"]
    (b,) = [b for b in blocked if b.producers[0] == "attn.qkv"]
    assert "splits the channels into 3 pieces of 4 heads of 8 with the head count written out" in b.reason
