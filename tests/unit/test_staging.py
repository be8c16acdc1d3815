"""export/deferred.py + staging.stage_streamed: the exporter traces placeholder weights and never
sees their values; each folded weight is computed and written one at a time, inline (one
protobuf merge chunk per initializer) or as external data, and the file reads back as the one
model it always was (large models export in bounded memory). Real torch.onnx.export, onnx
parsing and ONNX Runtime."""

import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.compressed.layer import CompressedLayer
from openamct.export.export_layer import working_copy
from openamct.export.fake_quant import fold_fake_quant
from openamct.export.ids import SAVE_ID_KEY
from openamct.export.writer import export_pair, export_to_file
from openamct.large.deferred import (
    PLACEHOLDER_DOMAIN,
    DeferredWeight,
    bind_placeholders,
    defer_tables,
)
from openamct.large.staging import _merged_order
from openamct.large.streamed_save import export_pair_streamed

CFG = """retrain_data_quant_config: { ulq_quantize: { } }
retrain_weight_quant_config: { arq_retrain: { channel_wise: true } }
prune_config: { n_out_of_m_pruner: { l1_selective_prune: { n_out_of_m_type: M4N2 } } }
"""


class Net(nn.Module):
    """Two Linears, one without bias; 3-D input, so the float weights go out as W^T."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _compressed(tmp_path, model=None, seed=0):
    torch.manual_seed(seed)
    model = Net() if model is None else model
    x = torch.randn(2, 5, 16)
    cfg = tmp_path / "c.cfg"
    cfg.write_text(CFG)
    c = amct.create_compressed_retrain_model(model, x, str(cfg), str(tmp_path / f"r{seed}.txt"))
    c.train()
    c(x).sum().backward()
    c.eval()
    with torch.no_grad():
        c(x)
    return c, x


def _run(path, x):
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def test_the_exporter_sees_placeholders_not_weights(tmp_path):
    c, x = _compressed(tmp_path)
    fake = fold_fake_quant(working_copy(c), c._openamct.techniques, defer=DeferredWeight)
    assert not any(p.numel() > 16 for n, p in fake.named_parameters()), "no folded weight is held"
    (tmp_path / "e").mkdir()
    proto = onnx.load(export_to_file(fake, x, str(tmp_path / "e")))
    nodes = [n for n in proto.graph.node if n.domain == PLACEHOLDER_DOMAIN]
    assert len(nodes) == 2
    assert [t.name for t in proto.graph.initializer] == ["a.bias"]


def test_a_weight_read_twice_is_bound_once():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2])
    nodes = [onnx.helper.make_node("Weight", [], [f"p{k}"], domain=PLACEHOLDER_DOMAIN, key="l.weight") for k in (0, 1)]
    nodes += [onnx.helper.make_node("MatMul", ["x", "p0"], ["h"]), onnx.helper.make_node("MatMul", ["h", "p1"], ["y"])]
    model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", [x], [y]))
    found = bind_placeholders(model, {"l.weight": "deferred", "other.weight": "unused"})
    assert found == {"l.weight": "deferred"}
    assert [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node] == [
        ("Weight", [], ["l.weight"]), ("MatMul", ["x", "l.weight"], ["h"]), ("MatMul", ["h", "l.weight"], ["y"])]
    with pytest.raises(ValueError, match="'l.weight'"):
        bind_placeholders(onnx.helper.make_model(onnx.helper.make_graph(nodes[:1], "g", [], [])), {})


def streamed_pair(*args, **kwargs):
    """``export_pair`` as the pipeline calls it for a CPU model (the streamed save)."""
    return export_pair(*args, streamed_save=export_pair_streamed, **kwargs)


def test_written_weights_are_the_folded_ones_in_the_exporters_order(tmp_path):
    c, x = _compressed(tmp_path)
    fake, deploy = str(tmp_path / "f.onnx"), str(tmp_path / "d.onnx")
    streamed_pair(c, fake, deploy, x)
    expected = {n: m.effective_weight_bias()[0].detach() for n, m in c.named_modules() if isinstance(m, CompressedLayer)}
    f = onnx.load(fake)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in f.graph.initializer}
    assert [t.name for t in f.graph.initializer] == ["a.weight_t", "a.bias", "b.weight_t"]
    for name, w in expected.items():
        np.testing.assert_array_equal(inits[f"{name}.weight_t"], w.t().numpy())
    assert not any(n.domain == PLACEHOLDER_DOMAIN for n in f.graph.node)
    assert all(o.domain in ("", "ai.onnx") for o in f.opset_import)
    d = onnx.load(deploy)
    q = {t.name: onnx.numpy_helper.to_array(t) for t in d.graph.initializer if t.name.endswith("weight_int8")}
    assert sorted(q) == ["a.weight_int8", "b.weight_int8"]
    for name, w in expected.items():
        scales = onnx.numpy_helper.to_array(
            next(t for t in d.graph.initializer if t.name == f"{name}.weight_fn.scales"))
        assert scales.shape == (w.shape[0],)
        np.testing.assert_array_equal(q[f"{name}.weight_int8"],
                                      np.clip(np.rint(w.numpy() / scales[:, None]), -128, 127).astype(np.int8))
    with torch.no_grad():
        ref = c(x).numpy()
    np.testing.assert_allclose(_run(fake, x), ref, rtol=0, atol=1e-5)
    assert np.abs(_run(deploy, x) - ref).max() < 0.1 * np.abs(ref).max()


def test_inline_and_external_files_are_the_same_model(tmp_path):
    c, x = _compressed(tmp_path)
    streamed_pair(c, str(tmp_path / "a_f.onnx"), str(tmp_path / "a_d.onnx"), x)
    streamed_pair(c, str(tmp_path / "b_f.onnx"), str(tmp_path / "b_d.onnx"), x, external_threshold=0)
    for kind in ("f", "d"):
        a = onnx.load(str(tmp_path / f"a_{kind}.onnx"))
        b = onnx.load(str(tmp_path / f"b_{kind}.onnx"))
        assert not os.path.exists(tmp_path / f"a_{kind}.onnx.data")
        stubs = onnx.load(str(tmp_path / f"b_{kind}.onnx"), load_external_data=False).graph.initializer
        offsets = [int({e.key: e.value for e in t.external_data}["offset"]) for t in stubs
                   if t.data_location == onnx.TensorProto.EXTERNAL]
        assert offsets and all(o % 4096 == 0 for o in offsets)
        def tensors(m):  # (onnx.load leaves data_location set on what it read from a .data file)
            return [(t.name, list(t.dims), t.data_type, onnx.numpy_helper.to_array(t).tobytes())
                    for t in m.graph.initializer]
        assert tensors(a) == tensors(b)
        assert [n.SerializeToString() for n in a.graph.node] == [n.SerializeToString() for n in b.graph.node]
        np.testing.assert_array_equal(_run(str(tmp_path / f"a_{kind}.onnx"), x), _run(str(tmp_path / f"b_{kind}.onnx"), x))


def test_the_save_id_follows_the_weights(tmp_path):
    ids = []
    for seed, tag in ((0, "x"), (0, "y"), (1, "z")):
        c, x = _compressed(tmp_path, seed=seed)
        streamed_pair(c, str(tmp_path / f"{tag}_f.onnx"), str(tmp_path / f"{tag}_d.onnx"), x)
        ids.append({p.key: p.value for p in onnx.load(str(tmp_path / f"{tag}_f.onnx")).metadata_props}[SAVE_ID_KEY])
    assert ids[0] == ids[1] != ids[2]


def test_merged_order_puts_each_weight_before_what_followed_it():
    order = ["a.w", "a.bias", "a.q.scales", "b.w", "c.w", "c.bias"]
    kept = ["a.bias", "a.q.scales", "c.bias", "onnx::Folded_1"]
    assert _merged_order(kept, {"a.w": None, "b.w": None, "c.w": None}, order) == \
        ["a.w", "a.bias", "a.q.scales", "b.w", "c.w", "c.bias", "onnx::Folded_1"]
    assert _merged_order(["onnx::F"], {"z.w": None}, ["z.w"]) == ["onnx::F", "z.w"]


@pytest.mark.parametrize("channel_wise", [True, False])
def test_a_weight_computed_in_the_scratch_is_the_folded_one(tmp_path, channel_wise):
    """The writer builds a Linear's export weight in reused buffers (no weight-sized temporary
    per layer): float W, W^T and int8, each equal to what the layer's eval path folds, for a
    Linear and for HF's Conv1D layout."""
    from transformers.pytorch_utils import Conv1D

    from openamct.export.export_layer import WeightDQ
    from openamct.large.deferred import DeferredWeight, WriteScratch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), Conv1D(24, 64), nn.ReLU(), nn.Linear(24, 8))
    cfg = CFG.replace("channel_wise: true", f"channel_wise: {str(channel_wise).lower()}")
    (tmp_path / "c.cfg").write_text(cfg)
    x = torch.randn(4, 16)
    c = amct.create_compressed_retrain_model(model, x, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"))
    c.train()
    c(x).sum().backward()
    c.eval()
    scratch = WriteScratch()
    layers = [m for m in working_copy(c).modules() if isinstance(m, CompressedLayer)]
    assert [m.kind for m in layers] == ["linear", "linear_t", "linear"]
    for layer in layers:
        w = layer.effective_weight_bias()[0].detach()
        w = w.t() if layer.kind == "linear_t" else w
        scales = layer.weight_scales()
        dq = WeightDQ(scales, 0 if channel_wise else None)
        for transposed in (False, True):
            d = DeferredWeight(layer, tuple(w.shape), transposed=transposed)
            expected = (w.t() if transposed else w).contiguous()
            got = d.compute(scratch)
            assert torch.equal(got, expected) and torch.equal(d.compute(), expected)
            slot = 1 if transposed != (layer.kind == "linear_t") else 0
            assert got.untyped_storage().data_ptr() == \
                scratch._flat[(slot, torch.float32)].untyped_storage().data_ptr(), "built in the scratch"
        q = DeferredWeight(layer, tuple(w.shape), quantize=dq)
        expected = torch.round(w / (scales.reshape(-1, 1) if channel_wise else scales)).clamp(-128, 127).to(torch.int8)
        assert torch.equal(q.compute(scratch), expected) and torch.equal(q.compute(), expected)


class ReadsWeight(Net):
    """HF ViT / T5 style: forward reads a layer's ``weight`` (its dtype) before calling it."""

    def forward(self, x):
        x = x.to(self.a.weight.dtype)
        return self.b(torch.relu(self.a(x)).to(self.b.weight.dtype))


def test_model_code_may_read_a_deferred_weight_while_it_is_traced(tmp_path):
    c, x = _compressed(tmp_path, ReadsWeight())
    streamed_pair(c, str(tmp_path / "f.onnx"), str(tmp_path / "d.onnx"), x)
    with torch.no_grad():
        ref = c(x).numpy()
    np.testing.assert_allclose(_run(str(tmp_path / "f.onnx"), x), ref, rtol=0, atol=1e-5)
    assert len(onnx.load(str(tmp_path / "f.onnx")).graph.initializer) == 3


class Tokens(nn.Module):
    """An embedding table above 1 MB, then a Linear: a language model's shape."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(320, 1024)
        self.fc = nn.Linear(1024, 8)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_an_embedding_table_is_written_from_the_models_tensor(tmp_path):
    torch.manual_seed(0)
    model = Tokens()
    ids = torch.randint(0, 320, (2, 6))
    (tmp_path / "c.cfg").write_text(CFG)
    c = amct.create_compressed_retrain_model(model, ids, str(tmp_path / "c.cfg"), str(tmp_path / "r.txt"))
    c.eval()
    with torch.no_grad():
        c(ids)
    fake = fold_fake_quant(working_copy(c), c._openamct.techniques, defer=DeferredWeight)
    defer_tables(fake)
    (tmp_path / "e").mkdir()
    traced = onnx.load(export_to_file(fake, ids, str(tmp_path / "e")))
    assert not any(t.name == "emb.weight" for t in traced.graph.initializer), "the exporter never held the table"
    streamed_pair(c, str(tmp_path / "f.onnx"), str(tmp_path / "d.onnx"), ids)
    for f in ("f.onnx", "d.onnx"):
        inits = {t.name: t for t in onnx.load(str(tmp_path / f)).graph.initializer}
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(inits["emb.weight"]), model.emb.weight.detach().numpy())
    sess = ort.InferenceSession(str(tmp_path / "f.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ref = c(ids).numpy()
    np.testing.assert_allclose(sess.run(None, {sess.get_inputs()[0].name: ids.numpy()})[0], ref, rtol=0, atol=1e-5)


class Widening(nn.Module):
    """Linears of growing size: the placeholders' zero mapping grows while they are made."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 256), nn.Linear(256, 512)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _largest_allocation(fn) -> int:
    """The largest block any op allocated through torch's allocator (its profiler's count)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize("kind", ["fake", "deploy"])
def test_eager_calls_of_a_folded_model_copy_out_no_weight(tmp_path, kind):
    """A zero-stride placeholder made every matmul copy it out whole first: a save at 1.1B
    parameters faulted 9.08 GB (now 2.23), its fake-quant export peaking +0.27 W."""
    from openamct.export.deploy import fold_deploy
    from openamct.large.deferred import ZeroPages, deferred_weights

    torch.manual_seed(0)
    x = torch.randn(1, 1, 64)  # activations (at most 2 KB) well under the smallest weight (16 KB)
    cfg = tmp_path / "c.cfg"
    cfg.write_text(CFG)
    c = amct.create_compressed_retrain_model(Widening(), x, str(cfg), str(tmp_path / "r.txt"))
    c.eval()
    with torch.no_grad():
        c(x)
    work = working_copy(c)
    if kind == "fake":
        work = fold_fake_quant(work, c._openamct.techniques, defer=DeferredWeight)
    else:
        fold_deploy(work, c._openamct.techniques, defer=DeferredWeight)
    defer_tables(work)
    smallest_weight = 64 * 64 * 4
    zeros = ZeroPages()  # one for the save, as streamed_save gives its weights
    for d in deferred_weights(work)[0].values():
        d.zeros = zeros
    try:
        with torch.no_grad():
            for _ in range(2):  # the second call reads what the first made, before the growth too
                assert _largest_allocation(lambda: work(x)) < smallest_weight
    finally:
        zeros.release()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_zero_views_are_zeros_no_page_backs_and_stay_placeholders_after_growth():
    from benchmarks.memory_probe import rss
    from openamct.export.export_layer import is_placeholder
    from openamct.large.deferred import ZeroPages

    zeros = ZeroPages()
    try:
        small = zeros.view((4, 8), torch.float32)
        big = zeros.view((4096, 4096), torch.float32)  # 64 MB: the mapping grows
        before = rss()
        assert big.is_contiguous() and int(torch.count_nonzero(big)) == 0 == int(torch.count_nonzero(small))
        assert rss() - before < 16 << 20  # read, they are the kernel's zero page
        assert is_placeholder(small) and is_placeholder(big)
        assert not is_placeholder(torch.zeros(4, 8)) and not is_placeholder(big.clone())
    finally:
        zeros.release()


def test_the_written_framing_is_protobufs_own():
    """The streamed writer frames each tensor by hand (so its bytes go to the file without a
    copy into a message): the framing must be the bytes protobuf itself writes, at every varint
    length boundary."""
    from openamct.large.staging import _graph_chunk

    for size in (0, 1, 100, 127, 128, 16_383, 16_384, 2_097_152):
        t = onnx.TensorProto(name="w", dims=[size], data_type=onnx.TensorProto.UINT8, raw_data=bytes(size))
        body = t.SerializeToString()
        chunk = onnx.ModelProto()
        chunk.graph.initializer.append(t)
        assert _graph_chunk(len(body)) + body == chunk.SerializeToString(), size
