"""The `openamct` command line: inspect and report (verify and demo have their own tests)."""

import json
import os
import subprocess
import sys

from openamct.cli import main
from tests.conftest import COMPAT, ROOT, checkout_env, compat_config


def test_inspect_prints_the_prune_complete_plan(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = main(["inspect", "--model", "tests.models:Net001", "--input-shape", "1,2,28,28",
               "--config", compat_config("configuration__net_001_prune_complete.cfg"), "--api", "prune"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("layer", "fc."))}
    assert "filter r=0.4" in rows["layer2.0"] and "align16" not in rows["layer2.0"]
    # 16 - round(6.4) = 10 kept, rounded up to a multiple of 4: layer5.0 (groups=4) consumes it
    assert "16 -> 12" in rows["layer2.0"]
    assert "filter r=0.5 align16" in rows["layer5.0"] and "32 -> 16" in rows["layer5.0"]
    assert "skipped" in rows["layer1.0"] and "skipped" in rows["fc.0"]
    assert "depthwise" in rows["layer3.0"]
    assert "MACs:" in out and "parameters:" in out


def test_inspect_counts_reduction_and_names_blocked_groups(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    cfg = tmp_path / "f.cfg"
    cfg.write_text("prune_config { filter_pruner { balanced_l2_norm_filter_prune { prune_ratio: 0.5 "
                   "ascend_optimized: false } } }\n")
    rc = main(["inspect", "--model", "tests.models:TwoConvNet", "--input-shape", "1,3,8,8", "--config", str(cfg),
               "--api", "prune"])
    out = capsys.readouterr().out
    assert rc == 0
    # by hand: conv1 3*8*9 = 216 weights, 64 positions -> 13,824 MACs; conv2 8*4*9 = 288, 18,432 MACs.
    # conv1 keeps 4 channels (conv2 loses the matching inputs); conv2 is the output and stays whole.
    assert "parameters: 504 -> 252 (50.0% fewer)" in out
    assert "MACs:       32,256 -> 16,128 (50.0% fewer)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("conv")}
    assert "8 -> 4" in rows["conv1"] and rows["conv2"].rstrip().endswith("4")
    assert "not pruned: group conv2: stopped at output: the channels reach the graph output" in out


def test_inspect_bad_config_is_one_line_error(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = main(["inspect", "--model", "tests.models:Net001", "--input-shape", "1,2,28,28",
               "--config", compat_config("configuration__net_001_prune_no_layer.cfg"), "--api", "prune"])
    err = capsys.readouterr().err
    assert rc == 2 and "layer 'layer2.3' does not exist" in err and "Traceback" not in err


def test_report_reads_upstream_record_as_json(capsys):
    rc = main(["report", os.path.join(COMPAT, "records", "record_NetTrainBranch.txt"), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    (layer,) = [entry for entry in data["layers"] if entry["layer"] == "layer1.0"]
    assert layer["channels"] == {"before": 16, "kept": 12, "group": 0}


def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "openamct")
    out = subprocess.run([exe, "--help"], env=checkout_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "inspect" in out.stdout and "verify" in out.stdout
