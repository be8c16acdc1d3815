"""Every python and bash block of README.md and docs/*.md runs as written (tests/docs/pages.py
says how a block asks for a fixture, or says why it is not run)."""

import pytest

from tests.docs.fixtures import Session
from tests.docs.pages import blocks, user_pages
from tests.docs.runner import run_block


def _params():
    for page in user_pages():
        slow = any("slow" in b.directives for b in blocks(page))
        yield pytest.param(page, id=page, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("page", list(_params()))
def test_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    session = Session(str(tmp_path))
    for block in blocks(page):
        if block.runs:
            run_block(block, session)
