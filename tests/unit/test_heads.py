"""Filter pruning of whole attention heads: Q/K/V rows by head, O's columns follow,
heads scored over all producers, GQA kept consistent, head-count attributes the forward reads
updated, recorded and replayed; what cannot be followed is refused with the module's name."""

import copy

import pytest
import torch
from torch import nn

from openamct.config.specs import LayerPlan, Plan
from openamct.graph.capture import capture_graph
from openamct.graph.layers import find_layers
from openamct.record import attrs
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.sparsity.consistency import consistent_groups
from openamct.sparsity.dependency import analyse
from openamct.sparsity.filter import apply_removal, score_and_select
from openamct.sparsity.filter_record import groups_from_records, groups_to_records
from openamct.techniques.filter_prune import FilterSpec
from tests.zoo.families import build


class Attention(nn.Module):
    """Older Hugging Face style: the head count and the merged size are module attributes."""

    def __init__(self, d=32, heads=4, literal_merge=False):
        super().__init__()
        self.num_heads, self.head_dim, self.all_head_size = heads, d // heads, d
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.literal_merge = literal_merge
        if literal_merge:
            del self.all_head_size  # the merge below writes 32 and nothing holds it

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, -1, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        ctx = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        ctx = ctx.transpose(1, 2).reshape(b, n, 32 if self.literal_merge else self.all_head_size)
        return self.o(ctx)


class Block(nn.Module):
    def __init__(self, d=32, **kw):
        super().__init__()
        self.attn, self.head = Attention(d=d, **kw), nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.attn(x)).mean(1)


def prune(model, inputs, ratio=0.3, ascend=False):
    graph = capture_graph(model, inputs)
    layers = find_layers(model, graph)
    plan = Plan({n: LayerPlan(n, i.type, {"filter_prune": FilterSpec(ratio, ascend)})
                 for n, i in layers.items() if i.type in ("Conv2d", "Linear", "Conv1D") and not i.depthwise})
    groups, blocked = analyse(graph, layers, plan, model)
    score_and_select(model, groups)
    return groups, blocked


def heads_group(groups, producer):
    return next(g for g in groups if producer in g.producer_names)


def test_bert_heads_prune_qkv_rows_and_output_columns():
    model, inputs = build("BERT")
    groups, _ = prune(model, inputs)
    g = heads_group(groups, "bert.encoder.layer.0.attention.self.query")
    assert sorted(g.producer_names) == ["bert.encoder.layer.0.attention.self." + p for p in ("key", "query", "value")]
    assert g.channels == 4 and {p.repeat for p in g.producers} == {8}  # 4 heads of 8
    (o,) = g.consumers
    assert (o.name, o.begin, o.end, o.repeat) == ("bert.encoder.layer.0.attention.output.dense", 0, 32, 8)
    assert len(g.removed) == 1  # 4 - round(4 * 0.3)
    before = model(**inputs).logits.shape
    apply_removal(model, groups)
    att = model.bert.encoder.layer[0].attention
    assert att.self.query.out_features == 24 and att.output.dense.in_features == 24
    assert model(**inputs).logits.shape == before


@pytest.mark.parametrize("small", [0, 2])
def test_heads_are_scored_over_all_producers(small):
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(2, 5, 32)
    with torch.no_grad():
        for p in (model.attn.q, model.attn.k, model.attn.v):
            p.weight.uniform_(-1, 1)
            p.weight[small * 8:(small + 1) * 8] *= 0.5  # this head is the weakest in every producer
        model.attn.q.weight[(3 - small) * 8:(4 - small) * 8] *= 0.1  # weakest in Q alone: not enough
    groups, _ = prune(model, x)
    assert heads_group(groups, "attn.q").removed == [small]


def test_gqa_removes_a_kv_head_with_its_query_heads():
    model, inputs = build("Llama")  # 4 query heads, 2 KV heads of 8
    groups, _ = prune(model, inputs)
    g = heads_group(groups, "model.layers.0.self_attn.q_proj")
    unit = {p.name.rsplit(".", 1)[1]: p.repeat for p in g.producers}
    assert g.channels == 2 and unit == {"q_proj": 16, "k_proj": 8, "v_proj": 8}
    (kv,) = g.removed
    q_before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    apply_removal(model, groups)
    att = model.model.layers[0].self_attn
    assert (att.q_proj.out_features, att.k_proj.out_features, att.o_proj.in_features) == (16, 8, 16)
    keep = [r for r in range(32) if r // 16 != kv]
    assert torch.equal(att.q_proj.weight, q_before[keep]) and att.num_key_value_groups == 2
    assert model(**inputs).logits.shape[:2] == inputs["input_ids"].shape


def test_head_count_and_merged_size_attributes_follow_and_replay():
    torch.manual_seed(0)
    original, x = Block().eval(), torch.randn(2, 5, 32)
    model = copy.deepcopy(original)
    groups, _ = prune(model, x, ratio=0.5)
    g = heads_group(groups, "attn.q")
    assert {m.name for m in g.passive if m.op_type == "Attribute"} == {"attn.num_heads", "attn.all_head_size"}
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    apply_removal(model, groups)
    assert (model.attn.num_heads, model.attn.all_head_size, model.attn.head_dim) == (2, 16, 8)
    fresh = copy.deepcopy(original)
    apply_removal(fresh, groups_from_records(record, fresh))
    assert (fresh.attn.num_heads, fresh.attn.all_head_size) == (2, 16)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_a_merged_size_written_out_is_proved_by_the_pruned_forward(caplog):
    # reshape(b, n, 32) with num_heads following: 32 may be num_heads * head_dim (GPT-Neo's
    # merge) or a constant; the graph cannot tell, the pruned forward can (a constant fails it)
    model, x = Block(literal_merge=True).eval(), torch.randn(2, 5, 32)
    groups, _ = prune(model, x, ratio=0.5)
    heads = [g for g in groups if "attn.q" in g.producer_names]
    assert heads and heads[0].removed
    assert consistent_groups(model, heads, x) == [] and "attn.q" in caplog.text
    assert model.attn.num_heads == 4 and model.attn.q.out_features == 32


def test_a_merged_size_without_a_following_head_count_is_refused():
    # the head count is -1 (nothing follows it) and the merge writes 32 with no attribute holding it
    class NoHeadAttr(Attention):
        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = (p(x).view(b, n, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
            ctx = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
            return self.o(ctx.transpose(1, 2).reshape(b, n, 32))

    model = Block().eval()
    model.attn = NoHeadAttr(literal_merge=True)
    _, blocked = prune(model.eval(), torch.randn(2, 5, 32))
    b = next(b for b in blocked if "attn.q" in b.producers)
    assert b.at.startswith("reshape_") and "writes the merged channel size 32 out, not -1" in b.reason


def _producer(record, name):
    return next(n for pr in record.prune_record for n in pr.producer if n.name == name)


def test_record_with_a_split_head_is_refused():
    torch.manual_seed(0)
    original, x = Block().eval(), torch.randn(2, 5, 32)
    groups, _ = prune(copy.deepcopy(original), x, ratio=0.5)
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    node = _producer(record, "attn.k")
    assert attrs.get_int(node, "prune_unit") == 8 and len(attrs.get_ints(node, "prune_index")) == 16
    rows = attrs.get_ints(node, "prune_index")
    for a in node.attr:
        if a.name == "prune_index":
            a.ClearField("ints")
            a.ints.extend(rows[1:])  # one row of a head left behind
    with pytest.raises(ValueError, match=r"'attn.k' prune_index does not remove whole units of prune_unit=8"):
        groups_from_records(record, copy.deepcopy(original))


def test_ascend_optimized_aligns_the_kept_rows_not_the_head_count():
    torch.manual_seed(0)
    model = Block(d=64, heads=4).eval()  # heads of 16 rows: any head count keeps a multiple of 16 rows
    groups, _ = prune(model, torch.randn(2, 5, 64), ratio=0.5, ascend=True)
    assert len(heads_group(groups, "attn.q").removed) == 2
