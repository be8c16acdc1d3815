"""T5's relative position bias: an Embedding with one column per head, added to the
attention scores of every layer. Its columns follow the pruned heads, which couples every
layer's heads through the one shared table; recorded and replayed exactly. A per-head bias
nothing can slice (a buffer) still blocks, naming it."""

import copy

import torch
from torch import nn

from openamct.record import attrs
from openamct.record.scale_offset_record_pb2 import ScaleOffsetRecord
from openamct.sparsity.filter import apply_removal
from openamct.sparsity.filter_record import groups_from_records, groups_to_records
from tests.unit.test_heads import heads_group, prune
from tests.zoo.families import build

SA = "encoder.block.{}.layer.0.SelfAttention"
BIAS = SA.format(0) + ".relative_attention_bias"


def test_t5_bias_columns_follow_the_heads_of_every_layer():
    original, inputs = build("T5-encoder")  # 2 layers, 4 heads of 8, the bias table in layer 0
    model = copy.deepcopy(original)
    groups, _ = prune(model, inputs, ratio=0.5)
    g = heads_group(groups, SA.format(0) + ".q")
    assert sorted(g.producer_names) == sorted(f"{SA.format(i)}.{p}" for i in (0, 1) for p in "qkv")
    assert sorted(c.name for c in g.consumers) == [SA.format(0) + ".o", SA.format(1) + ".o"]
    (bias,) = [m for m in g.passive if m.name == BIAS]
    assert (bias.op_type, bias.begin, bias.end, bias.repeat) == ("Gather", 0, 4, 1) and len(g.removed) == 2
    table = model.get_submodule(BIAS).weight.detach().clone()
    record = ScaleOffsetRecord()
    groups_to_records(groups, record)
    apply_removal(model, groups)
    keep = [h for h in range(4) if h not in g.removed]
    emb = model.get_submodule(BIAS)
    assert emb.embedding_dim == 2 and torch.equal(emb.weight, table[:, keep])
    with torch.no_grad():
        out = model(**inputs).last_hidden_state
    assert out.shape == (2, 12, 32)
    node = next(n for pr in record.prune_record for n in pr.consumer if n.name == BIAS)
    assert attrs.get_str(node, "type") == "Gather" and attrs.get_ints(node, "prune_index") == g.removed
    fresh = copy.deepcopy(original)
    apply_removal(fresh, groups_from_records(record, fresh))
    with torch.no_grad():
        assert torch.equal(fresh(**inputs).last_hidden_state, out)


class BufferBias(nn.Module):
    """A per-head score bias held in a buffer: nothing says it is per head, so it blocks."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.q, self.k, self.v, self.o = 4, *(nn.Linear(32, 32) for _ in range(4))
        self.register_buffer("bias", torch.randn(1, 4, 5, 5))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, -1, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        ctx = torch.softmax(q @ k.transpose(-1, -2) + self.bias, -1) @ v
        return self.o(ctx.transpose(1, 2).reshape(b, n, -1)).mean(1)


def test_a_per_head_bias_from_a_buffer_blocks_naming_it():
    _, blocked = prune(BufferBias().eval(), torch.randn(2, 5, 32))
    b = next(b for b in blocked if "q" in b.producers)
    assert b.at.startswith("add_") and "parameter 'bias'" in b.reason
