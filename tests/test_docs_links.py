"""The README and docs/ point at things that exist: every relative link resolves to a file (and its anchor to a
heading of that file), and every repository path a page names (deltafin/..., tests/..., bench/...) exists.

Anchors are GitHub's: the heading's text, lower-cased, without markup and punctuation, spaces as hyphens, a
repeated heading numbered -1, -2, ...
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
#: a path inside the repository, as pages name them in prose, in code spans and in commands
_REPO_PATH = re.compile(r"(?<![\w./~-])((?:deltafin|tests|bench|scripts|conf|docs)/[\w./*{},-]*[\w*}])")


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(page.read_text()):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(page: Path) -> list[str]:
    found = []
    for line in _prose_lines(page.read_text()):
        found += _LINK.findall(_CODE_SPAN.sub("", line))
    return found


def _broken_link(page: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    path_part, _, anchor = target.partition("#")
    dest = (page.parent / path_part).resolve() if path_part else page
    if not dest.exists():
        return f"{target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target}: no heading #{anchor} in {dest.name}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = [b for t in links(page) if (b := _broken_link(page, t))]
    assert broken == [], f"{page.relative_to(ROOT)}: broken links"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(page):
    missing = []
    for line in _prose_lines(page.read_text()) if page.name != "config.md" else page.read_text().splitlines():
        for name in _REPO_PATH.findall(line):
            name = name.rstrip(".")
            if "/" not in name.partition("/")[2] and "." not in name and "*" not in name:
                continue  # one word after the folder, no suffix: a ratio's name ("deltafin/llama-server")
            pattern = re.sub(r"\{[^}]*\}", "*", name)  # `{a,b}` alternatives: any file of the folder
            pattern = re.sub(r"\b[A-Z][A-Z_]+\b", "*", pattern)  # a placeholder (`conf/model/FAMILY.yaml`)
            if not list(ROOT.glob(pattern)) and not (ROOT / name).exists():
                missing.append(name)
    assert missing == [], f"{page.relative_to(ROOT)} names paths that do not exist"


def test_the_slug_follows_github():
    assert slug("Responses API (`/v1/responses`)") == "responses-api-v1responses"
    assert slug("bench/claude_code_prefix.py (Claude Code: the billing line)") == (
        "benchclaude_code_prefixpy-claude-code-the-billing-line"
    )
    assert slug("`llama/`, `quant/`, `kernels/`: the fast paths") == "llama-quant-kernels-the-fast-paths"


def test_a_broken_link_and_anchor_are_caught(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page.write_text("[ok](other.md#a-section) [gone](missing.md) [bad](other.md#nope) `[code](x.md)`\n")
    broken = [b for t in links(page) if (b := _broken_link(page, t))]
    assert broken == ["missing.md: no such file", "other.md#nope: no heading #nope in other.md"]
