"""`openamct prune-search`: the report table, the written config, the chart, user errors."""

import json

import pytest
from google.protobuf import text_format

from openamct.cli import main
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig


def test_prune_search_prints_one_row_per_group_and_writes_the_config(tmp_path, capsys):
    cfg, out, chart = tmp_path / "s.cfg", tmp_path / "found.cfg", tmp_path / "chart.png"
    cfg.write_text("compress_ratio: 2\n")
    rc = main(["prune-search", "--model", "openamct.demo.models:MnistNet", "--config", str(cfg), "--out", str(out),
               "--input-shape", "4,1,28,28", "--chart", str(chart)])
    text = capsys.readouterr().out
    assert rc == 0
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("layer", "fc"))}
    assert set(rows) == {"layer1.0", "layer2.0", "layer3.0", "layer4.0"}  # fc: blocked (graph output)
    assert rows["layer4.0"][1] == "128" and "%" in rows["layer4.0"][-1]
    assert "MACs per sample, prunable layers: 10,952,192 ->" in text and "fc: not pruned" in text
    found = AMCTRetrainConfig()
    text_format.Merge(out.read_text(), found)
    kept = {r[0]: int(r[2]) for r in rows.values()}
    for o in found.override_layer_configs:
        ch = int(rows[o.layer_name][1])
        assert o.prune_config.filter_pruner.balanced_l2_norm_filter_prune.prune_ratio == \
            (ch - kept[o.layer_name]) / ch
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prune_search_json_and_user_errors(tmp_path, capsys):
    cfg, out = tmp_path / "s.cfg", tmp_path / "found.cfg"
    cfg.write_text("compress_ratio: 1.5\n")
    assert main(["prune-search", "--model", "openamct.demo.models:MnistNet", "--config", str(cfg), "--out", str(out),
                 "--input-shape", "2,1,28,28", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["budget"] == "macs" and report["macs_before"] / report["macs_after"] >= 1.5
    cfg.write_text("max_prune_ratio: 0.5\n")
    assert main(["prune-search", "--model", "openamct.demo.models:MnistNet", "--config", str(cfg), "--out", str(out),
                 "--input-shape", "2,1,28,28"]) == 2
    assert "compress_ratio is missing" in capsys.readouterr().err
    assert main(["prune-search", "--model", "openamct.demo.models:MnistNet", "--config", str(cfg),
                 "--out", str(out)]) == 2
    assert "--data" in capsys.readouterr().err


def test_macs_shares_add_up_to_the_whole(tmp_path, capsys):
    cfg, out = tmp_path / "s.cfg", tmp_path / "found.cfg"
    cfg.write_text("compress_ratio: 1.5\n")
    assert main(["prune-search", "--model", "openamct.demo.models:MnistNet", "--config", str(cfg), "--out", str(out),
                 "--input-shape", "2,1,28,28", "--json"]) == 0
    shares = [g["macs_share"] for g in json.loads(capsys.readouterr().out)["groups"]]
    # each prunable layer's MACs counted once: to the group pruning its outputs, else split
    # among the groups pruning its inputs (the fc, whose outputs stay, reads one group)
    assert len(shares) == 4 and sum(shares) == pytest.approx(1.0) and all(0 < s < 1 for s in shares)
