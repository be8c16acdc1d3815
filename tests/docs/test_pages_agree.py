"""The pages agree with the code: a feature listed as not implemented is not exported, every
exported function is documented, the command table and every ``openamct CMD --option`` a page
names exist, the supported-layer table says what the layer table holds, and every link
resolves."""

import argparse
import os
import re

import pytest

import openamct
from openamct.cli import build_parser
from openamct.layer_types import LAYER_TYPES
from tests.docs.pages import ROOT, blocks, user_pages


def _text(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _section(text: str, heading: str) -> str:
    """The body of the section whose heading starts with ``heading`` (up to the next heading)."""
    m = re.search(rf"^#+ {re.escape(heading)}.*$", text, re.M)
    if m is None:
        return ""
    rest = text[m.end():]
    nxt = re.search(r"^#+ ", rest, re.M)
    return rest[: nxt.start()] if nxt else rest


def _exported(name: str) -> bool:
    """A public function or class of ``openamct`` by that name (a subpackage of the same name,
    such as ``openamct.sparsity``, the filter-pruning internals, is not one: it is not callable)."""
    return name in openamct.__all__ or callable(getattr(openamct, name, None))


def test_nothing_listed_as_not_implemented_is_exported():
    listed = {}
    for page in user_pages():
        for heading in ("Not implemented", "Not in this release"):
            for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", _section(_text(page), heading)):
                listed.setdefault(name, page)
    assert {"create_quant_config", "quantize_model"} <= set(listed), "the list moved: update this test"
    shipped = {name: page for name, page in listed.items() if _exported(name)}
    assert not shipped, f"listed as not implemented, but openamct exports them: {shipped}"


def test_every_exported_function_is_documented():
    readme = _text("README.md")
    missing = [name for name in openamct.__all__ if f"`{name}" not in readme and f" {name}" not in readme]
    assert not missing, f"README.md's API table lacks {missing}"


def _commands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_the_command_table_lists_every_command():
    table = set(re.findall(r"^\| `openamct ([a-z-]+)` \|", _text("docs/README.md"), re.M))
    assert table == set(_commands())


def test_every_option_a_page_names_exists():
    commands = {name: {o for a in p._actions for o in a.option_strings} for name, p in _commands().items()}
    wrong = []
    for page in user_pages():
        text = _text(page) + "".join(b.code for b in blocks(page))
        for cmd, rest in re.findall(r"openamct ([a-z-]+)((?:\\\n|[^`\n])*)", text):
            if cmd not in commands:
                continue
            for option in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", rest):
                if option not in commands[cmd] and option not in ("-v",):
                    wrong.append(f"{page}: openamct {cmd} {option}")
    assert not wrong, wrong


def test_the_supported_layer_table_says_what_the_code_does():
    rows = {}
    for line in _text("docs/supported.md").splitlines():
        m = re.match(r"^\| `(\w+)`[^|]*\|([^|]*)\|([^|]*)\|([^|]*)\|([^|]*)\|", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.groups()[1:]]
    assert set(rows) == set(LAYER_TYPES)
    for name, (int8, int4, nm, filt) in rows.items():
        t = LAYER_TYPES[name]
        assert int8 == "yes" and int4 == "yes", name
        assert nm == ("yes" if t.nm else "no"), f"{name}: 2:4 column {nm!r}"
        want = {"active": "yes", "consumer": "follows its input", "": "no"}[t.filter]
        assert filt.split(" (")[0] == want, f"{name}: filter pruning column {filt!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", [*user_pages(), "benchmarks/README.md",
                                  *(f"docs/dev/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "docs", "dev"))))])
def test_links_resolve(page):
    folder = os.path.dirname(os.path.join(ROOT, page))
    text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(folder, path)) if path else os.path.join(ROOT, page)
        if not os.path.exists(full):
            broken.append(target)
            continue
        if anchor and full.endswith(".md"):
            with open(full, encoding="utf-8") as f:
                anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", f.read(), re.M)}
            if anchor not in anchors:
                broken.append(target)
    assert not broken, f"{page}: {broken}"
