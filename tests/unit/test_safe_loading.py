"""Safe loading: checkpoints load with ``weights_only=True``, so a checkpoint that
carries a pickle payload is refused with a clear ValueError before anything runs; config and
record parsing never evaluate their contents.

Each payload would create a marker file when unpickled; the tests check that restore refuses
the file and that the marker does not exist, and (so the test can fail) that an unsafe
``torch.load`` of the very same file does create it.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import openamct as amct
from openamct.checkpoint import read_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")


class Payload:
    """Unpickling this calls open(path, "w"): a file appears. Stands for any code execution."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return builtins.open, (self.path, "w")


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.relu(self.conv(x))), 1))


X = torch.randn(4, 8, 6, 6)
QUANT = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
NM = "prune_config { n_out_of_m_pruner { l1_selective_prune { } } }\n"
CONFIGS = {"prune": NM, "compressed": QUANT + NM, "quant": QUANT}


def restore(api: str, cfg: str, rec: str, pth: str, name: str | None = "state_dict"):
    if api == "prune":
        return amct.restore_prune_retrain_model(TinyNet(), X, rec, cfg, pth, name)
    if api == "compressed":
        return amct.restore_compressed_retrain_model(TinyNet(), X, cfg, rec, pth, name)
    return amct.restore_quant_retrain_model(cfg, TinyNet(), rec, X, pth, name)


def create(api: str, cfg: str, rec: str):
    if api == "prune":
        return amct.create_prune_retrain_model(TinyNet(), X, cfg, rec)
    if api == "compressed":
        return amct.create_compressed_retrain_model(TinyNet(), X, cfg, rec)
    return amct.create_quant_retrain_model(cfg, TinyNet(), rec, X)


@pytest.fixture(params=sorted(CONFIGS))
def trained(request, tmp_path):
    """(api, cfg, record, state_dict) of a compressed TinyNet run once in train and eval mode."""
    api = request.param
    cfg, rec = str(tmp_path / "c.cfg"), str(tmp_path / "rec.txt")
    with open(cfg, "w") as f:
        f.write(CONFIGS[api])
    model = create(api, cfg, rec)
    model.train()
    model(X).sum().backward()
    model.eval()
    model(X)
    return api, cfg, rec, model.state_dict()


def payload_files(tmp_path, sd):
    """name -> (checkpoint path, state_dict_name, marker path) for every place a payload can hide."""
    files = {}

    def marker(tag):
        return str(tmp_path / f"pwned_{tag}")

    def save(tag, obj, name="state_dict", **kw):
        path = str(tmp_path / f"{tag}.pth")
        torch.save(obj, path, **kw)
        files[tag] = (path, name, marker(tag))

    save("top_level", {"state_dict": sd, "extra": Payload(marker("top_level"))})
    save("inside_state_dict", {"state_dict": {**sd, "conv.weight": Payload(marker("inside_state_dict"))}})
    save("as_tensor_value", {**sd, "fc.bias": Payload(marker("as_tensor_value"))}, name=None)
    save("in_unused_key", {"state_dict": sd, "optimizer": {"step": Payload(marker("in_unused_key"))}})
    save("legacy_format", {"state_dict": sd, "x": Payload(marker("legacy_format"))},
         _use_new_zipfile_serialization=False)
    raw = str(tmp_path / "raw_pickle.pth")  # a plain pickle file, not torch's zip format
    with open(raw, "wb") as f:
        pickle.dump({"state_dict": Payload(marker("raw_pickle"))}, f)
    files["raw_pickle"] = (raw, "state_dict", marker("raw_pickle"))
    return files


def test_malicious_checkpoints_are_refused_and_nothing_runs(trained, tmp_path):
    api, cfg, rec, sd = trained
    record_before = open(rec, "rb").read()
    files = payload_files(tmp_path, sd)
    for tag, (path, name, marker) in files.items():
        with pytest.raises(ValueError, match=r"(?s)refused.*weights_only=True") as info:
            restore(api, cfg, rec, path, name)
        assert path in str(info.value), tag  # the message names the file
        assert not os.path.exists(marker), f"{tag}: the payload ran"
    assert open(rec, "rb").read() == record_before  # a refused restore leaves the record alone
    # The payloads are live: an unsafe load of the same files does run them.
    for tag, (path, _, marker) in files.items():
        try:
            torch.load(path, weights_only=False)
        except Exception:
            pass
        assert os.path.exists(marker), f"{tag}: payload did not fire under weights_only=False"


def test_the_clean_checkpoint_of_the_same_model_restores(trained, tmp_path):
    api, cfg, rec, sd = trained
    path = str(tmp_path / "clean.pth")
    torch.save({"state_dict": sd}, path)
    model = restore(api, cfg, rec, path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())


def test_read_state_dict_refuses_payload_anywhere(tmp_path):
    marker = str(tmp_path / "pwned")
    path = str(tmp_path / "ck.pth")
    torch.save({"state_dict": {"w": torch.ones(2)}, "meta": [1, {"x": Payload(marker)}]}, path)
    with pytest.raises(ValueError, match="refused"):
        read_state_dict(path, "state_dict")
    assert not os.path.exists(marker)


def test_non_tensor_values_and_garbage_files_are_clear_errors(tmp_path):
    path = str(tmp_path / "ck.pth")
    torch.save({"state_dict": {"w": torch.ones(2), "step": 3}}, path)  # loads safely, not a state dict
    with pytest.raises(ValueError, match="does not hold a state dict"):
        read_state_dict(path, "state_dict")
    # The last three once escaped as struct.error, IndexError and KeyError.
    for data in (b"", b"\x80\x05garbage", b"PK\x03\x04truncated zip", b"\x80\x04MF",
                 b"\x80\x03\x86\xa8\xff\xed*\xd5b\xb2I\xaf\xe0\x94{6\xe9\x06\xb5t\xff",
                 b"h\xab$\x98%g\xddN"):
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(ValueError, match="refused"):
            read_state_dict(path, None)


@pytest.fixture(scope="module")
def real_checkpoints(tmp_path_factory):
    """The bytes of a real checkpoint in torch's zip format and in the legacy format."""
    d = tmp_path_factory.mktemp("ckpts")
    sd = {"state_dict": TinyNet().state_dict()}
    out = []
    for kw in ({}, {"_use_new_zipfile_serialization": False}):
        torch.save(sd, d / "c.pth", **kw)
        out.append((d / "c.pth").read_bytes())
    return out


@given(data=st.data())
@settings(derandomize=True, deadline=2000, database=None, max_examples=400,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_corrupt_checkpoints_are_value_errors(real_checkpoints, tmp_path_factory, data):
    """Truncated, bit-flipped, spliced and random files: a clear ValueError, nothing else."""
    raw = data.draw(st.sampled_from(real_checkpoints))
    op = data.draw(st.integers(0, 3))
    if op == 0:  # a save killed mid-write
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif op == 1:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1:]
    elif op == 2:
        i = data.draw(st.integers(0, len(raw)))
        raw = raw[:i] + data.draw(st.binary(min_size=1, max_size=64)) + raw[i:]
    else:
        raw = data.draw(st.sampled_from([b"\x80\x02", b"\x80\x04", b"PK\x03\x04", b""])) + \
            data.draw(st.binary(max_size=128))
    path = tmp_path_factory.getbasetemp() / "corrupt.pth"
    path.write_bytes(raw)
    try:
        sd = read_state_dict(str(path), "state_dict")
    except ValueError as exc:
        assert "pth_file" in str(exc)
        return
    assert all(isinstance(v, torch.Tensor) for v in sd.values())  # a flip that missed the structure


# -- config and record parsing never evaluate anything -----------------------------------------

CODE = [
    "__import__('builtins').open({m!r}, 'w')",
    "exec(\"open({m!r}, 'w')\")",
    "eval(compile(\"open({m!r}, 'w')\", 'x', 'exec'))",
    "!!python/object/apply:builtins.open [{m!r}, 'w']",
    "batch_num: __import__('builtins').open({m!r}, 'w')",
    "skip_layers: \"\" + open({m!r}, 'w').name",
    "{{'batch_num': open({m!r}, 'w')}}",
    "import os; os.system('touch {m}')",
    "batch_num: 1\n$(touch {m})\n`touch {m}`",
]


@pytest.mark.parametrize("api", sorted(CONFIGS))
@pytest.mark.parametrize("code", CODE, ids=range(len(CODE)))
def test_config_holding_python_code_is_only_a_parse_error(api, code, tmp_path):
    marker = str(tmp_path / "pwned")
    cfg = tmp_path / "c.cfg"
    cfg.write_text(code.format(m=marker))
    with pytest.raises(ValueError, match="c.cfg"):
        create(api, str(cfg), str(tmp_path / "rec.txt"))
    assert not os.path.exists(marker)
    assert not os.path.exists(tmp_path / "rec.txt")  # refused before any work


def test_quant_json_holding_python_code_is_only_an_error(tmp_path):
    marker = str(tmp_path / "pwned")
    cfg = tmp_path / "q.json"
    for doc in [json.dumps({"conv": f"__import__('builtins').open({marker!r}, 'w')"}),
                json.dumps({"batch_num": f"open({marker!r}, 'w')", "fc": {}}),
                json.dumps({"conv": {"retrain_enable": f"exec(open({marker!r}, 'w'))"}})]:
        cfg.write_text(doc)
        with pytest.raises(ValueError, match="q.json"):
            amct.create_quant_retrain_model(str(cfg), TinyNet(), str(tmp_path / "rec.txt"), X)
        assert not os.path.exists(marker)


@pytest.mark.parametrize("code", CODE, ids=range(len(CODE)))
def test_record_holding_python_code_is_only_a_parse_error(trained, code, tmp_path):
    api, cfg, _, sd = trained
    marker = str(tmp_path / "pwned")
    rec = tmp_path / "evil_rec.txt"
    rec.write_text(code.format(m=marker))
    pth = str(tmp_path / "ck.pth")
    torch.save({"state_dict": sd}, pth)
    with pytest.raises(ValueError, match="evil_rec.txt"):
        restore(api, cfg, str(rec), pth)
    assert not os.path.exists(marker)
