"""Run one page's blocks in order, as a reader pasting them into one Python session and one
shell, both in one fresh folder: python blocks share a namespace, bash blocks run in
``bash -e -o pipefail`` with this checkout's ``openamct`` on PATH."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

from google.protobuf import text_format

from tests.docs.fixtures import FIXTURES, Session
from tests.docs.pages import ROOT, Block

PACKAGE = os.path.join(ROOT, "openamct") + os.sep


def check_config(block: Block) -> None:
    """Parse the block as the config it says it is: protobuf's own text parser, as openamct
    and upstream read config files (a field given twice, a misspelled field fail here)."""
    from openamct.config.auto_channel_prune_config_pb2 import AutoChannelPruneConfig
    from openamct.config.retrain_config_pb2 import AMCTRetrainConfig
    from openamct.distill.distill_config_pb2 import AMCTDistillConfig

    kinds = {"retrain": AMCTRetrainConfig, "distill": AMCTDistillConfig, "search": AutoChannelPruneConfig}
    kind = block.directives["config"]
    if kind not in kinds:
        raise AssertionError(f"{block.where}: config kind {kind!r} is not one of {sorted(kinds)}")
    try:
        text_format.Parse(block.code, kinds[kind]())
    except text_format.ParseError as exc:
        raise AssertionError(f"{block.where}: not a valid {kind} config: {exc}") from None


def _run_python(block: Block, session: Session) -> None:
    # Leading newlines: a traceback names the line of the Markdown page.
    code = compile("\n" * (block.line - 1) + block.code, os.path.join(ROOT, block.page), "exec")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(code, session.namespace)
    ours = [f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}: {w.category.__name__}: {w.message}"
            for w in caught if os.path.abspath(w.filename).startswith(PACKAGE)]
    assert not ours, f"{block.where}: openamct raised warnings a reader would see:\n" + "\n".join(ours)


def _run_bash(block: Block, session: Session) -> None:
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join([ROOT, *session.python_path]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=session.folder, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (f"{block.where}: exit code {out.returncode}\n--- stdout\n{out.stdout[-3000:]}"
                                 f"\n--- stderr\n{out.stderr[-3000:]}")


def run_block(block: Block, session: Session) -> None:
    for name in block.setups:
        if name not in FIXTURES:
            raise AssertionError(f"{block.where}: no fixture {name!r} (tests/docs/fixtures.py has {sorted(FIXTURES)})")
        if name not in session.done:
            FIXTURES[name](session)
            session.done.add(name)
    d = block.directives
    if "file" in d:
        path = os.path.join(session.folder, d["file"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(block.code)
    if "config" in d:
        check_config(block)
    if block.lang not in ("python", "bash"):
        return
    run = _run_python if block.lang == "python" else _run_bash
    if "raises" not in d:
        run(block, session)
        return
    kind, _, text = d["raises"].partition(":")
    try:
        run(block, session)
    except Exception as exc:  # the block's own exception, raised by exec
        names = [c.__name__ for c in type(exc).__mro__]
        assert kind.strip() in names, f"{block.where}: raised {type(exc).__name__}: {exc}, not {kind}"
        assert text.strip() in str(exc), f"{block.where}: the message {str(exc)!r} does not hold {text.strip()!r}"
    else:
        raise AssertionError(f"{block.where}: expected {kind.strip()}, but the block ran")
