"""The fenced code blocks of the user documentation (README.md and docs/*.md), with the
directive each carries.

A directive is an HTML comment on the line before a fence (blank lines between are allowed):
GitHub does not render it, and a reader of the Markdown source sees it next to the block.

    <!-- setup: resnet18 -->              run the named fixtures (tests/docs/fixtures.py) first
    <!-- not-run: <reason> -->            do not run this block; the reason is required
    <!-- slow -->                         the page's test is in the slow tier
    <!-- file: retrain.cfg -->            write the block to that file for the blocks after it
    <!-- config: retrain -->              the block must parse as that config (retrain, distill, search)
    <!-- raises: ValueError: <text> -->   the block must raise that exception, its message holding <text>

Several directives go in one comment, separated by ``;``. Python and bash blocks run unless
marked ``not-run``; blocks in other languages run only through ``file``/``config``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNABLE = ("python", "bash")
KEYS = ("setup", "not-run", "slow", "file", "config", "raises")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<lang>[^`\s]*)\s*$")
_COMMENT = re.compile(r"^\s*<!--(?P<body>.*?)-->\s*$")


@dataclass
class Block:
    page: str          # path relative to the repository root
    line: int          # 1-based line of the first line of code
    lang: str
    code: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        if "not-run" in self.directives:
            return False
        return self.lang in RUNNABLE or "file" in self.directives or "config" in self.directives

    @property
    def setups(self) -> list[str]:
        return [s.strip() for s in self.directives.get("setup", "").split(",") if s.strip()]


def user_pages() -> list[str]:
    """README.md and docs/*.md (not docs/dev/: contributors' notes), relative to the root."""
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md", *(f"docs/{f}" for f in docs)]


def parse_directives(body: str, where: str) -> dict[str, str]:
    """``key: value; key2`` -> {key: value, key2: ""}; an unknown key is a ValueError. A
    ``not-run:`` reason runs to the end of the comment (it may hold semicolons)."""
    out = {}
    head, found, reason = body.partition("not-run:")
    if found:
        out["not-run"] = reason.strip()
    for part in head.split(";"):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.partition(":")
        key = key.strip()
        if key not in KEYS:
            raise ValueError(f"{where}: unknown directive {key!r} (known: {', '.join(KEYS)})")
        out[key] = value.strip()
    if "not-run" in out and not out["not-run"]:
        raise ValueError(f"{where}: not-run needs a reason: <!-- not-run: why -->")
    return out


def blocks(page: str) -> list[Block]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang").lower()
        directives = {}
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        c = _COMMENT.match(lines[k]) if k >= 0 else None
        if c and "-->" not in lines[k][:lines[k].index("<!--")]:
            directives = parse_directives(c.group("body"), f"{page}:{k + 1}")
        body, j = [], i + 1
        closing = re.compile(r"^\s*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$")
        while j < len(lines) and not closing.match(lines[j]):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{page}:{i + 1}: a fence that never closes")
        found.append(Block(page, i + 2, lang, "\n".join(body) + "\n", directives))
        i = j + 1
    return found
