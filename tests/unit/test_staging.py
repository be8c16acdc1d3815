"""export/staging.py: the exporter's file is staged without being loaded back, and above 2 GB
its one-file-per-tensor layout is merged into the single ``<file>.data`` save promises (issue
19). The 2 GB layout is produced here by onnx itself (``all_tensors_to_one_file=False``), the
way the TorchScript exporter writes it, on a small real export."""

import hashlib
import os

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from openamct.export.staging import SAVE_ID_KEY, stage_export
from openamct.export.writer import export_to_file


def _exported(tmp_path, per_tensor_files: bool) -> tuple[str, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(3, 16)
    folder = tmp_path / "export"
    folder.mkdir()
    file = export_to_file(model, x, str(folder))
    if per_tensor_files:
        proto = onnx.load(file)
        # A Constant's tensor goes out too (the exporter's 1.1B Llama: its rotary constants).
        out = proto.graph.output[0].name
        bias = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)
        const = onnx.helper.make_node("Constant", [], ["extra"], value=onnx.numpy_helper.from_array(bias))
        add = onnx.helper.make_node("Add", [out + "_pre", "extra"], [out])
        for n in proto.graph.node:
            n.output[:] = [o + "_pre" if o == out else o for o in n.output]
        proto.graph.node.extend([const, add])
        onnx.save_model(proto, file, save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0,
                        convert_attribute=True)
        assert len(os.listdir(folder)) > 2
    return file, model, x


def _run(path: str, x: torch.Tensor) -> np.ndarray:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def test_tensor_files_are_merged_into_one_aligned_data_file(tmp_path):
    file, model, x = _exported(tmp_path, per_tensor_files=True)
    stage = tmp_path / "stage"
    stage.mkdir()
    h = hashlib.sha256()
    staged = stage_export(file, str(tmp_path / "out.onnx"), str(stage), external_threshold=2**31, h=h)
    assert os.listdir(tmp_path / "export") == ["model.onnx"], "each tensor file is deleted once copied"
    staged.finish("abc")
    assert sorted(os.listdir(tmp_path)) == ["export", "out.onnx", "out.onnx.data", "stage"]
    proto = onnx.load(str(tmp_path / "out.onnx"), load_external_data=False)
    infos = [{e.key: e.value for e in t.external_data} for t in proto.graph.initializer]  # (the Constant's below)
    assert infos and all(i["location"] == "out.onnx.data" and int(i["offset"]) % 4096 == 0 for i in infos)
    assert {p.key: p.value for p in proto.metadata_props}[SAVE_ID_KEY] == "abc"
    const = next(n for n in proto.graph.node if n.op_type == "Constant").attribute[0].t
    assert {e.key: e.value for e in const.external_data}["location"] == "out.onnx.data"
    expected = _run_direct(model, x, tmp_path) + np.linspace(-1, 1, 8, dtype=np.float32)
    np.testing.assert_allclose(_run(str(tmp_path / "out.onnx"), x), expected, rtol=0, atol=1e-6)


def _run_direct(model, x, tmp_path) -> np.ndarray:
    folder = tmp_path / "direct"
    folder.mkdir()
    return _run(export_to_file(model, x, str(folder)), x)


def test_a_single_file_is_moved_and_hashed_as_written(tmp_path):
    file, model, x = _exported(tmp_path, per_tensor_files=False)
    with open(file, "rb") as f:
        written = f.read()
    stage = tmp_path / "stage"
    stage.mkdir()
    h = hashlib.sha256()
    staged = stage_export(file, str(tmp_path / "out.onnx"), str(stage), external_threshold=2**31, h=h)
    staged.finish("abc")
    with open(tmp_path / "out.onnx", "rb") as f:
        final = f.read()
    assert final.startswith(written), "the exporter's bytes, then the stamp"
    loaded = onnx.load_from_string(final)
    assert {p.key: p.value for p in loaded.metadata_props}[SAVE_ID_KEY] == "abc"
    assert h.hexdigest() == hashlib.sha256(written + b"\0").hexdigest()


def test_another_export_gives_another_digest(tmp_path):
    digests = []
    for k, scale in enumerate((1.0, 2.0)):
        folder = tmp_path / f"e{k}"
        folder.mkdir()
        model = nn.Linear(4, 4).eval()
        with torch.no_grad():
            model.weight.fill_(scale)
        file = export_to_file(model, torch.randn(2, 4), str(folder))
        stage = tmp_path / f"s{k}"
        stage.mkdir()
        h = hashlib.sha256()
        stage_export(file, str(tmp_path / f"o{k}.onnx"), str(stage), external_threshold=2**31, h=h)
        digests.append(h.hexdigest())
    assert digests[0] != digests[1]
