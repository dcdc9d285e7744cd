"""The documentation stays navigable: the README is a short front door, every relative link and
anchor in README.md and docs/*.md resolves, no page narrates history, and the option tables of
docs/usage.md are what `ops/docs/usage.py` writes from the parser today. Text only, no model: cheap."""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
INLINE_CODE = re.compile(r"`+[^`]*`+")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
# Phrases that tell the story of the code instead of describing it.
NARRATION = re.compile(
    r"\b(now that|previously|this round|used to (?:be|default)|before this change|no longer)\b", re.I
)


def prose(text: str) -> str:
    """The text without fenced code blocks (where `#` lines and brackets are code, not markdown)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, punctuation dropped, spaces
    as hyphens (`Structured output (--response-format)` -> `structured-output---response-format`)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page defines: its headings' slugs (repeats numbered as GitHub numbers them)."""
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(prose(path.read_text())):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[str]:
    """The targets of a page's markdown links outside code."""
    text = INLINE_CODE.sub("", prose(path.read_text()))
    return [match.group(1) for match in LINK.finditer(text)]


def dead_links(path: Path) -> list[str]:
    dead = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... are not checked here
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            dead.append(f"{target} (no such heading in {linked.name})")
    return dead


def test_the_readme_is_a_short_front_door():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    assert not dead_links(page), dead_links(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_sentence_narrates_history(page: Path):
    found = [m.group(0) for m in NARRATION.finditer(prose(page.read_text()))]
    assert not found, f"{page.name} describes history, not the code: {found}"


def test_the_checker_sees_dead_links_and_anchors(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Structured output (`--response-format`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](other.md#structured-output---response-format) [self](#title) [web](https://x.y)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) `[code](nope.md)`\n\n```\n[fenced](nope.md)\n```\n"
    )
    assert dead_links(page) == ["missing.md (no such file)", "other.md#nope (no such heading in other.md)"]


def usage_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_usage", ROOT / "ops" / "docs" / "usage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_usage_md_lists_the_options_the_parser_has():
    script = usage_script()
    current = script.USAGE.read_text()
    assert script.rendered(current) == current, (
        "docs/usage.md is stale: run .venv/bin/python ops/docs/usage.py"
    )
