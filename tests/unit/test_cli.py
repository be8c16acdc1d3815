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


def test_every_option_says_its_default_and_options_follow_the_command(capsys, monkeypatch):
    import argparse

    from openamct.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name, command in sub.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            text = action.help or ""
            positional = not action.option_strings
            if not text or not (positional or "default" in text or "(required)" in text):
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}: {text!r}")
    assert not missing, missing
    monkeypatch.chdir(ROOT)
    rc = main(["inspect", "-v", "--model", "tests.models:Net001", "--input-shape", "1,2,28,28",
               "--config", compat_config("configuration__net_001_prune_complete.cfg"), "--api", "prune"])
    assert rc == 0 and "filter r=0.4" in capsys.readouterr().out


def test_inspect_names_the_weight_format(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    cfg = tmp_path / "int4.cfg"
    cfg.write_text("retrain_data_quant_config { ulq_quantize { } }\n"
                   "retrain_weight_quant_config { arq_retrain { dst_type: INT4 channel_wise: true } }\n")
    assert main(["inspect", "--model", "tests.models:TwoConvNet", "--input-shape", "1,3,8,8", "--config",
                 str(cfg)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("conv")}
    assert "INT8 ULQ" in rows["conv1"] and "INT4 ARQ per-ch" in rows["conv1"]


def test_report_of_an_empty_record_says_so(capsys, tmp_path):
    record = tmp_path / "record.txt"
    record.write_text("# openamct-fingerprint: 0123456789abcdef (1 layers)\n")
    assert main(["report", str(record)]) == 0
    assert "no entries yet" in capsys.readouterr().out


def test_report_into_a_closed_pipe_exits_quietly(tmp_path):
    record = tmp_path / "record.txt"  # a report far longer than a pipe's buffer
    record.write_text("".join(f'record {{ key: "layer{i}" value {{ scale_d: 0.5 offset_d: 0 }} }}\n'
                              for i in range(4000)))
    exe = os.path.join(os.path.dirname(sys.executable), "openamct")
    proc = subprocess.Popen([exe, "report", str(record)], env=checkout_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and first.startswith(b"record:")
    assert "Traceback" not in err and "BrokenPipe" not in err, err
