"""``openamct verify`` and save_*'s ``fp32_model=`` / ``report=``: the files told apart by
their content, deploy compared with FP32 in speed and agreement, figures that mean something
at batch 1 (agreement over several inputs, near-ties named)."""

import os

import numpy as np
import onnx
import pytest
import torch

import openamct as amct
from openamct.cli import main
from openamct.export.agreement import compare_outputs
from openamct.export.onnx_kinds import FP32_OF_KEY, file_info
from openamct.export.verify import format_verification, summary_line, verify_files, verify_pair
from tests.models import ResBlockNet

CFG = ("retrain_data_quant_config { ulq_quantize { } }\n"
       "retrain_weight_quant_config { arq_retrain { channel_wise: true } }\n")
X = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def resblock():
    torch.manual_seed(0)
    return ResBlockNet().eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(prefix, the report line) of one save with fp32_model= and report=."""
    folder = tmp_path_factory.mktemp("verify")
    (folder / "q.cfg").write_text(CFG)
    fp32 = resblock()
    m = amct.create_compressed_retrain_model(fp32, X, str(folder / "q.cfg"), str(folder / "r.txt"))
    m.eval()
    m(X)
    lines = []
    prefix = str(folder / "net")
    amct.save_compressed_retrain_model(m, str(folder / "r.txt"), prefix, X, fp32_model=fp32, report=lines.append)
    return prefix, lines


def test_save_writes_the_fp32_export_and_reports_one_line(saved):
    prefix, lines = saved
    deploy, fake, fp32 = (f"{prefix}_{k}_model.onnx" for k in ("deploy", "fake_quant", "fp32"))
    assert [file_info(p).kind for p in (deploy, fake, fp32)] == ["deploy", "fake-quant", "fp32"]
    meta = {p.key: p.value for p in onnx.load(fp32).metadata_props}
    assert meta[FP32_OF_KEY] == file_info(deploy).save_id
    (line,) = lines
    assert line.startswith("deploy vs FP32 (ONNX Runtime CPU, 2 threads, x [1, 3, 16, 16]): ")
    assert "x as fast" in line and "cosine to FP32" in line and "same top-1" in line
    assert "float compute ops left:" in line


def test_files_are_told_apart_whatever_their_order(saved):
    prefix, _ = saved
    deploy, fake, fp32 = (f"{prefix}_{k}_model.onnx" for k in ("deploy", "fake_quant", "fp32"))
    r = verify_files([fp32, deploy, fake], (1, 3, 16, 16), runs=2, samples=4)
    assert r["files"] == {"deploy": deploy, "fake-quant": fake, "fp32": fp32}
    assert set(r["agreement"]) == {"fake-quant", "fp32"}
    assert r["speedup_vs_fp32"] == pytest.approx(r["latency_ms"]["fp32"] / r["latency_ms"]["deploy"])
    # batch 1, 4 inputs: top-1 is counted over 4 rows, never over the single row of one batch
    assert r["agreement"]["fp32"]["output"]["rows"] == 4
    assert "QLinearConv" in r["integer_kernels"]
    text = format_verification(r)
    assert "deploy is" in text and "as fast as FP32" in text and "deploy vs FP32, output 'output'" in text
    assert summary_line(r).startswith("deploy vs FP32")
    with pytest.raises(ValueError, match="wrong way round"):
        verify_pair(deploy, fake, (1, 3, 16, 16))
    with pytest.raises(ValueError, match="all hold integer weights"):
        verify_files([deploy, deploy], (1, 3, 16, 16))


def test_cli_takes_the_fp32_model_from_a_factory_and_files_in_any_order(saved, capsys):
    prefix, _ = saved
    rc = main(["verify", f"{prefix}_deploy_model.onnx", f"{prefix}_fake_quant_model.onnx", "--fp32-model",
               "tests.unit.test_verify:resblock", "--input-shape", "1,3,16,16", "--runs", "2", "--samples", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FP32:" in out and "as fast as FP32" in out and "on 3 of 3 rows" in out.replace("top-1 on", "on")


def test_agreement_names_near_ties_and_not_real_flips():
    ref = [np.array([[1.0, 0.99, 0.0]]), np.array([[5.0, 0.0, 0.0]]), np.array([[0.0, 3.0, 0.0]])]
    # row 0: a near-tie flips (margin 0.01 < 2 x max diff 0.2); row 1: a decisive row flips
    other = [np.array([[0.9, 1.09, 0.0]]), np.array([[0.0, 5.1, 0.0]]), np.array([[0.0, 3.0, 0.0]])]
    a = compare_outputs(ref, other)
    assert (a["rows"], a["same_top1"], a["near_ties"]) == (3, 1, 1)
    assert a["max_abs_diff"] == pytest.approx(5.1) and a["rel_diff"] == pytest.approx(5.1 / 5.0)
    b = compare_outputs([np.ones((2, 4))], [np.ones((2, 4))])
    assert b["cosine_min"] == pytest.approx(1.0) and b["same_top1"] == 2 and b["near_ties"] == 0


def test_save_extras_are_checked_before_any_work(tmp_path):
    (tmp_path / "q.cfg").write_text(CFG)
    m = amct.create_compressed_retrain_model(resblock(), X, str(tmp_path / "q.cfg"), str(tmp_path / "r.txt"))
    m.eval()
    m(X)
    with pytest.raises(TypeError, match="report must be a callable"):
        amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "a"), X, report="yes")
    with pytest.raises(ValueError, match="fp32_model is a compressed model"):
        amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "a"), X, fp32_model=m)
    assert not os.path.exists(tmp_path / "a_deploy_model.onnx")
    amct.save_compressed_retrain_model(m, str(tmp_path / "r.txt"), str(tmp_path / "b"), X)
    assert sorted(p.name for p in tmp_path.glob("b_*")) == ["b_deploy_model.onnx", "b_fake_quant_model.onnx"]
