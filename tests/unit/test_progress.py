"""Progress of long steps: a tqdm bar on a terminal, INFO log lines otherwise, nothing for a
step that ends quickly."""

import io
import logging
import os
import sys

from openamct.progress import Progress

logger = logging.getLogger("openamct.test_progress")


def test_without_a_terminal_it_logs_lines(caplog, monkeypatch):
    monkeypatch.setattr(sys, "stderr", open(os.devnull, "w"))  # noqa: SIM115 - closed by the interpreter
    with caplog.at_level(logging.INFO, logger=logger.name):
        with Progress("save", total=3, logger=logger, every=0.0) as p:
            p.update(what="fake-quant model exported")
            p.update()
        quick = Progress("create", total=2, logger=logger)  # default every=10 s: a quick step says nothing
        quick.update()
        quick.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("save: 1/3 (fake-quant model exported), ") and lines[1].startswith("save: 2/3, ")
    assert lines[-1].startswith("save: 2/3") and lines[-1].endswith(": done")
    assert not any(line.startswith("create") for line in lines)


class Terminal(io.StringIO):
    """What a terminal's stderr says about itself (tqdm only writes to it)."""

    def isatty(self):
        return True


def test_on_a_terminal_it_draws_a_bar(caplog, monkeypatch):
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    with caplog.at_level(logging.INFO, logger=logger.name):
        with Progress("latency table", total=2, logger=logger, unit="layer", delay=0.0, every=0.0) as p:
            p.update(what="conv1")
            p.update(what="conv2")
    drawn = tty.getvalue()
    assert "latency table" in drawn and "/2" in drawn and "layer" in drawn
    assert not caplog.records  # the bar, not log lines
