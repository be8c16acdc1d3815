"""LSTM / GRU QAT in the graph flow: quantizers per (layer, direction), record entries, exact
restore, fake-quant ONNX against torch, deploy ONNX with int8 weights in ONNX Runtime, and
filter-pruning groups that end at a recurrent layer."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import openamct as amct
from openamct.compressed.recurrent import RecurrentLayer
from tests.small import HALF_FILTERS, INT8, restores_the_same, write_cfg


class SeqNet(nn.Module):
    """``proj`` (Linear) -> ``rnn`` (LSTM/GRU) -> last step -> ``fc``."""

    def __init__(self, kind=nn.LSTM, feat: int = 6, hidden: int = 12, **kw):
        super().__init__()
        self.proj = nn.Linear(feat, feat)
        self.rnn = kind(feat, hidden, batch_first=True, **kw)
        self.fc = nn.Linear(hidden * (2 if kw.get("bidirectional") else 1), 3)

    def forward(self, x):
        y, _ = self.rnn(torch.relu(self.proj(x)))
        return self.fc(y[:, -1])


CASES = {
    "lstm": (nn.LSTM, {}),
    "gru_2layer_bidir": (nn.GRU, {"num_layers": 2, "bidirectional": True}),
    "lstm_2layer_nobias": (nn.LSTM, {"num_layers": 2, "bias": False}),
}


def _trained(tmp_path, kind, kw, seed=0):
    torch.manual_seed(seed)
    model = SeqNet(kind, **kw)
    x = torch.randn(4, 7, 6)
    m = amct.create_compressed_retrain_model(model, x, write_cfg(tmp_path), str(tmp_path / "r.txt"))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    m.train()
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(4, 7, 6)).square().mean().backward()
        opt.step()
    m.eval()
    return model, m, x


def _ort(path, x):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]


def _cos(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("case", CASES)
def test_create_train_restore_save(tmp_path, case):
    kind, kw = CASES[case]
    model, m, x = _trained(tmp_path, kind, kw)
    rnn = m.rnn
    assert isinstance(rnn, RecurrentLayer) and not isinstance(model.rnn, RecurrentLayer)  # caller's model kept
    dirs = 2 if kw.get("bidirectional") else 1
    assert len(rnn.h_quant) == kw.get("num_layers", 1) * dirs
    # weights per row: one scale per gate row
    gates = 4 if kind is nn.LSTM else 3
    assert rnn.weight_scales("weight_hh_l0").numel() == gates * 12
    # restore computes exactly the same
    restores_the_same(m, lambda ck: amct.restore_compressed_retrain_model(
        model, x, write_cfg(tmp_path), str(tmp_path / "r.txt"), ck), x, tmp_path / "m.pth")
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "out"), x)
    record = (tmp_path / "r.txt").read_text()
    keys = ["rnn"] if case == "lstm" else [f"rnn.l{k}{s}" for k in range(kw.get("num_layers", 1))
                                           for s in ([""] if dirs == 1 else ["", "_reverse"])]
    for key in keys:
        assert f'key: "{key}"' in record
    assert "scale_h:" in record and "scale_r:" in record
    with torch.no_grad():
        want = m(x).numpy()
    fake = _ort(str(tmp_path / "out_fake_quant_model.onnx"), x)
    assert _cos(fake, want) >= 0.9999
    np.testing.assert_allclose(fake, want, atol=1e-4)
    deploy_path = str(tmp_path / "out_deploy_model.onnx")
    deploy = onnx.load(deploy_path)
    op = "LSTM" if kind is nn.LSTM else "GRU"
    assert sum(n.op_type == op for n in deploy.graph.node) == kw.get("num_layers", 1)
    inits = {i.name: i for i in deploy.graph.initializer}
    rnn_node = next(n for n in deploy.graph.node if n.op_type == op)
    w_src = next(n for n in deploy.graph.node if rnn_node.input[1] in n.output)
    while w_src.op_type in ("Concat", "Unsqueeze"):  # directions, then gate blocks
        w_src = next(n for n in deploy.graph.node if w_src.input[0] in n.output)
    assert w_src.op_type == "DequantizeLinear"
    assert inits[w_src.input[0]].data_type == onnx.TensorProto.INT8
    assert list(inits[w_src.input[0]].dims) == [12, 6]  # one gate block of weight_ih_l0: [hidden, features]
    got = _ort(deploy_path, x)
    assert _cos(got, want) >= 0.999, _cos(got, want)  # the hidden state is float in the deploy model


def test_hidden_state_quantizer_is_in_the_path(tmp_path):
    _, m, x = _trained(tmp_path, nn.LSTM, {})
    with torch.no_grad():
        before = m(x)
        q = m.rnn.h_quant["l0"]
        q.clip_max.fill_(0.05)
        q.clip_min.fill_(-0.05)
        after = m(x)
    assert not torch.allclose(before, after)


def test_training_reaches_the_quantizer_clips(tmp_path):
    _, m, _ = _trained(tmp_path, nn.GRU, {})
    m.train()
    m(torch.randn(4, 7, 6)).square().mean().backward()
    assert m.rnn.h_quant["l0"].clip_max.grad is not None and m.rnn.x_quant["l0"].clip_max.grad is not None
    assert m.rnn.weight_ih_l0.grad is not None


def test_unquantized_recurrence_matches_torch():
    """run_recurrent with identity quantizers is torch's module (gate order and equations)."""
    from openamct.compressed.recurrent import run_recurrent

    torch.manual_seed(1)
    for kind in (nn.LSTM, nn.GRU):
        mod = kind(5, 7, num_layers=2, bidirectional=True, batch_first=True).eval()
        mod.mode = kind.__name__
        x, h0 = torch.randn(3, 4, 5), torch.randn(4, 3, 7)
        hx = (h0, torch.randn(4, 3, 7)) if kind is nn.LSTM else h0
        want = mod(x, hx)
        got = run_recurrent(mod, x, hx, lambda n, m=mod: getattr(m, n, None), lambda k, t: t, lambda s, t: t)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


def test_proj_size_stays_float(tmp_path, caplog):
    torch.manual_seed(0)
    model = SeqNet(nn.LSTM, proj_size=4)
    model.fc = nn.Linear(4, 3)
    x = torch.randn(2, 5, 6)
    m = amct.create_compressed_retrain_model(model, x, write_cfg(tmp_path), str(tmp_path / "r.txt"))
    assert type(m.rnn) is nn.LSTM
    assert "proj_size" in caplog.text


def test_packed_sequence_is_refused(tmp_path):
    _, m, _ = _trained(tmp_path, nn.LSTM, {})
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(2, 5, 6), [5, 3], batch_first=True)
    with pytest.raises(TypeError, match="PackedSequence"):
        m.rnn(packed)


def test_filter_groups_end_at_a_recurrent_layer(tmp_path):
    """``proj`` feeds the LSTM only: its filters are not pruned (the LSTM cannot drop inputs),
    and the LSTM is still quantized beside the pruning."""
    torch.manual_seed(0)
    model = SeqNet(nn.LSTM)
    x = torch.randn(2, 5, 6)
    m = amct.create_compressed_retrain_model(model, x, write_cfg(tmp_path, INT8 + HALF_FILTERS),
                                             str(tmp_path / "r.txt"))
    assert m.proj.weight.shape == model.proj.weight.shape
    assert isinstance(m.rnn, RecurrentLayer)


def test_dynamic_quantize_lstm_rewrite(tmp_path):
    _, m, x = _trained(tmp_path, nn.LSTM, {"bidirectional": True})
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "out"), x)
    src = str(tmp_path / "out_deploy_model.onnx")
    dst = str(tmp_path / "dyn.onnx")
    assert amct.dynamic_quantize_lstm(src, dst) == 1
    ops = {n.op_type for n in onnx.load(dst).graph.node}
    assert "DynamicQuantizeLSTM" in ops and "LSTM" not in ops
    assert _cos(_ort(dst, x), _ort(src, x)) >= 0.999


def test_dynamic_quantize_lstm_refuses_a_file_without_lstm(tmp_path):
    _, m, x = _trained(tmp_path, nn.GRU, {})
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "out"), x)
    with pytest.raises(ValueError, match="no LSTM"):
        amct.dynamic_quantize_lstm(str(tmp_path / "out_deploy_model.onnx"), str(tmp_path / "dyn.onnx"))
    assert not (tmp_path / "dyn.onnx").exists()
    with pytest.raises(ValueError, match="does not exist"):
        amct.dynamic_quantize_lstm(str(tmp_path / "missing.onnx"), str(tmp_path / "dyn.onnx"))


def test_a_record_written_before_recurrent_layers_were_quantized_restores(tmp_path):
    """Earlier openamct left LSTM/GRU float and did not list them in a record's fingerprint. Such
    a record (here: the LSTM skipped by the config, its fingerprint line removed) restores with
    the same config; a record that lists recurrent layers is still compared on them."""
    torch.manual_seed(0)
    model, x = SeqNet(), torch.randn(4, 7, 6)
    cfg = write_cfg(tmp_path, INT8 + 'skip_layer_types: "LSTM"\n')
    m = amct.create_compressed_retrain_model(model, x, cfg, str(tmp_path / "r.txt"))
    m.train()
    m(x)
    m.eval()
    torch.save(m.state_dict(), tmp_path / "m.pth")
    text = (tmp_path / "r.txt").read_text()
    assert "# openamct-layer: rnn LSTM" in text
    old = "".join(ln for ln in text.splitlines(keepends=True) if not ln.startswith("# openamct-layer: rnn "))
    (tmp_path / "old.txt").write_text(old)
    back = amct.restore_compressed_retrain_model(SeqNet(), x, cfg, str(tmp_path / "old.txt"), str(tmp_path / "m.pth"))
    back.eval()
    assert torch.equal(back(x), m(x))
    renamed = text.replace("# openamct-layer: rnn LSTM", "# openamct-layer: rnn2 LSTM")
    (tmp_path / "other.txt").write_text(renamed)
    with pytest.raises(ValueError, match="describes another model"):
        amct.restore_compressed_retrain_model(SeqNet(), x, cfg, str(tmp_path / "other.txt"), str(tmp_path / "m.pth"))


class StateNet(nn.Module):
    """An LSTM (or GRU) started from an initial state the caller gives."""

    def __init__(self, kind=nn.LSTM):
        super().__init__()
        self.rnn = kind(6, 8, batch_first=True, bidirectional=True)
        self.kind = kind

    def forward(self, x, h0, c0):
        y, _ = self.rnn(x, (h0, c0) if self.kind is nn.LSTM else h0)
        return y[:, -1]


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_an_initial_state_reaches_the_deploy_models_recurrence(tmp_path, kind):
    """The deploy file's LSTM/GRU reads the initial state (its optional inputs written out: full
    sequence lengths, the state), and gives the fake-quant file's output in ONNX Runtime."""
    torch.manual_seed(0)
    inputs = (torch.randn(3, 5, 6), torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    m = amct.create_compressed_retrain_model(StateNet(kind), inputs, write_cfg(tmp_path), str(tmp_path / "r.txt"))
    m.eval()
    m(*inputs)
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "out"), inputs)
    runs = {}
    for which in ("fake_quant", "deploy"):
        s = ort.InferenceSession(str(tmp_path / f"out_{which}_model.onnx"), providers=["CPUExecutionProvider"])
        feed = {i.name: t.numpy() for i, t in zip(s.get_inputs(), inputs)}
        runs[which] = s.run(None, feed)[0]
    node = next(n for n in onnx.load(str(tmp_path / "out_deploy_model.onnx")).graph.node if n.op_type == kind.__name__)
    assert len(node.input) >= 6 and node.input[5], list(node.input)  # initial_h is wired, not left off
    assert _cos(runs["deploy"], runs["fake_quant"]) > 0.999
    zero = tuple(t if i == 0 else torch.zeros_like(t) for i, t in enumerate(inputs))
    s = ort.InferenceSession(str(tmp_path / "out_deploy_model.onnx"), providers=["CPUExecutionProvider"])
    moved = s.run(None, {i.name: t.numpy() for i, t in zip(s.get_inputs(), zero)})[0]
    assert not np.allclose(moved, runs["deploy"])  # the state changes the output
