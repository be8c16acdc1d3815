"""``openamct demo``: the run, its outputs, an exact resume, and one-line user errors.

The fast tests run the real demo with 1 epoch; the slow one runs it at full size and checks the
accuracy and size acceptance (speed is reported by the demo, not asserted by a test).
"""

from __future__ import annotations

import copy
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from openamct.cli import main as cli_main
from openamct.demo import bench
from openamct.demo import run as demo
from openamct.demo.data import DataSplit, load_mnist_5k
from openamct.demo.models import MnistNet
from openamct.demo.report import HEADER, format_table, render_chart, table_cells
from openamct.demo.train import evaluate, train_mnist
from openamct.export.int8_kernels import u8s8_saturates
from tests.numerics import assert_logits_agree, skip_unless_exact_int8_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ["mnist_fp32_model.onnx", "mnist_fake_quant_model.onnx", "mnist_deploy_model.onnx", "record.txt",
         "checkpoint.pth", "report.md", "results.json", "chart.png"]


def run_demo(out: str, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openamct.cli", "demo", "--out", out, *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo") / "out")
    proc = run_demo(out, "--epochs", "1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        return out, proc.stdout, json.load(f)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def md_tables(path: str) -> list[list[list[str]]]:
    tables, current = [], []
    for line in open(path, encoding="utf-8").read().splitlines() + [""]:
        if line.startswith("|"):
            if not line.startswith("|---"):
                current.append([c.strip() for c in line.strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    return tables


def onnx_logits(path: str, x: torch.Tensor):
    """Logits as bench.onnx_accuracy computes them (its session options, batches of 250)."""
    import numpy as np

    sess = bench.session(path)
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: x[i:i + 250].numpy()})[0] for i in range(0, len(x), 250)])


def png_size(path: str) -> tuple[int, int]:
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_quick_demo_writes_everything(quick):
    out, stdout, results = quick
    for name in FILES:
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    assert [m["name"] for m in results["models"]] == ["FP32", "fake-quant", "deploy"]
    assert results["resumed_at_step"] == results["total_steps"] // 2 > 0
    assert "deploy vs FP32" in stdout


def test_printed_table_and_report_hold_the_json_numbers(quick):
    out, stdout, results = quick
    assert format_table(results) in stdout
    main_table = md_tables(os.path.join(out, "report.md"))[0]
    assert main_table[0] == list(HEADER)
    assert main_table == table_cells(results)


def test_json_numbers_are_measured_from_the_files(quick, one_thread):
    out, _, results = quick
    data = load_mnist_5k()
    for m in results["models"]:
        path = os.path.join(out, m["file"])
        assert m["size_bytes"] == os.path.getsize(path)
        assert (m["params"], m["nonzero"]) == bench.weight_counts(path)
        assert m["accuracy"] == bench.onnx_accuracy(bench.session(path), data.x_test, data.y_test)
        assert m["speedup"] == pytest.approx(results["models"][0]["latency_ms"] / m["latency_ms"])
    fp32, fake, deploy = results["models"]
    assert deploy["size_bytes"] < fake["size_bytes"] < fp32["size_bytes"]
    assert deploy["nonzero"] < deploy["params"] < fp32["params"]  # 2:4 zeros, pruned channels
    assert deploy["macs"] < fp32["macs"]
    # The fake-quant ONNX reproduces the PyTorch compressed model. Up to float rounding: a conv's
    # last bit at a rounding midpoint of the next quantizer moves a digit's logits by <= 0.07 % of
    # their range (measured by perturbing every layer output by up to 32 ulps, as a CPU with other
    # float sums would: <= 12 % of digits moved, none of 12,000 predictions changed). So a change
    # of more than 2 of the 1,000 predictions is a real difference, on any CPU.
    assert abs(fake["accuracy"] - results["torch_accuracy"]["compressed"]) <= 0.002
    kept = {ly["layer"]: ly for ly in results["layers"]}
    assert kept["layer2.0"]["channels_kept"] < kept["layer2.0"]["channels_before"]
    assert kept["fc"]["zeros_2_4"] == pytest.approx(0.5) and kept["layer4.0"]["zeros_2_4"] is None
    assert all(ly["scale_d"] > 0 for ly in results["layers"])


def test_chart_is_a_png_drawn_from_the_run_numbers(quick, tmp_path):
    out, _, results = quick
    chart = os.path.join(out, "chart.png")
    width, height = png_size(chart)
    assert width >= 800 and height >= 400
    again = str(tmp_path / "again.png")
    render_chart(results, again)  # from results.json: the same bytes as the demo's chart
    assert open(again, "rb").read() == open(chart, "rb").read()
    changed = copy.deepcopy(results)
    changed["models"][2]["latency_ms"] *= 3
    other = str(tmp_path / "other.png")
    render_chart(changed, other)
    assert open(other, "rb").read() != open(chart, "rb").read()


def test_resumed_retraining_equals_an_uninterrupted_one(tmp_path, one_thread):
    full = load_mnist_5k()
    data = DataSplit(full.x_train[:800], full.y_train[:800], full.x_test, full.y_test)
    torch.manual_seed(0)
    fp32 = MnistNet()
    train_mnist(fp32, data.x_train, data.y_train, epochs=1, progress=False)
    fp32.eval()
    cfg = demo.default_config()
    outs = [str(tmp_path / d) for d in ("straight", "resumed")]
    for d in outs:
        os.makedirs(d)
    straight, none = demo.compress(fp32, data, cfg, outs[0], epochs=2, interrupt=False)
    resumed, step = demo.compress(fp32, data, cfg, outs[1], epochs=2, interrupt=True)
    assert none is None and step == 25  # 2 epochs x 25 batches of 32, interrupted halfway
    ckpt = torch.load(os.path.join(outs[1], "checkpoint.pth"), weights_only=True)
    assert {"state_dict", "optimizer", "step"} <= set(ckpt)
    a, b = straight.state_dict(), resumed.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert evaluate(straight, data.x_test, data.y_test) == evaluate(resumed, data.x_test, data.y_test)


@pytest.mark.parametrize("text, expect", [
    (None, "no such file"),
    ("prune_config { filter_pruner { oops } }", "line"),
    ('retrain_data_quant_config { ulq_quantize { } }\nskip_layers: "layer9.0"', "layer9.0"),
])
def test_bad_config_is_one_line_and_exit_code_2(tmp_path, capsys, text, expect):
    path = str(tmp_path / "bad.cfg")
    if text is not None:
        open(path, "w").write(text)
    rc = cli_main(["demo", "--out", str(tmp_path / "out"), "--config", path])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("openamct demo: --config") and expect in err
    assert not os.path.exists(tmp_path / "out" / "results.json")


@pytest.mark.parametrize("extra", ["mlxtend", "matplotlib"])
def test_missing_extra_says_how_to_install(tmp_path, extra):
    code = (f"import sys; sys.modules[{extra!r}] = None\n"  # as if the package were not installed
            "from openamct.cli import main\n"
            f"sys.exit(main(['demo', '--out', {str(tmp_path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert extra in proc.stderr and "pip install 'openamct[demo]'" in proc.stderr


@pytest.mark.slow
def test_full_demo_meets_the_acceptance(tmp_path):
    out = str(tmp_path / "out")
    proc = run_demo(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    fp32, fake, deploy = results["models"]
    assert results["epochs"] == {"fp32": demo.FP32_EPOCHS, "retrain": demo.RETRAIN_EPOCHS}
    # Seeds 0-2 and 1 or 2 threads (other weights, as other CPUs give): FP32 98.5-98.7 %, deploy
    # -0.3..+0.3 points from it. The bounds leave at least 5 and 7 of the 1,000 digits.
    assert fp32["accuracy"] >= 0.98
    assert deploy["accuracy"] >= fp32["accuracy"] - 0.01
    # Was "fake and deploy accuracy within 0.3 point": true while fewer than 4 of the 1,000 digits
    # have a top-2 margin below the deploy graph's own rounding noise, which depends on where
    # training lands on each CPU. Now the logits: noise bounded at 4x its measured maximum
    # relative to their range (0.0015-0.0020, cosine >= 0.999998 over those runs), argmax equal
    # wherever the margin beats twice the noise (>= 99.7 % of the digits measured), and the two
    # accuracies may differ only by the digits left (the JSON's numbers: same sessions, batches).
    assert deploy["smaller"] >= 4
    assert fp32["macs"] / deploy["macs"] >= 2
    assert format_table(results) in proc.stdout
    assert results["latency"]["u8s8_saturates"] == u8s8_saturates()
    skip_unless_exact_int8_kernels()  # where ORT's u8s8 kernels saturate, the logits are ORT's, not the file's
    data = load_mnist_5k()
    fake_logits, deploy_logits = (onnx_logits(os.path.join(out, m["file"]), data.x_test) for m in (fake, deploy))
    stats = assert_logits_agree(fake_logits, deploy_logits, max_rel_diff=0.008, min_decisive=0.95,
                                min_cosine=0.9999, what="demo")
    assert abs(fake["accuracy"] - deploy["accuracy"]) <= 1 - stats["decisive"] + 1e-9
    assert md_tables(os.path.join(out, "report.md"))[0] == table_cells(results)
    png_size(os.path.join(out, "chart.png"))
