"""What the documentation tests read in a Markdown page: its headings with GitHub's
anchors and the text under each, and the links and inline code of its prose."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = ("```", "~~~")


@dataclass(frozen=True)
class Section:
    """A heading (its level, text and anchor) and the text under it, up to the next heading."""

    level: int
    title: str
    anchor: str
    body: str


def prose_lines(text: str) -> Iterator[str]:
    """The lines of a Markdown text outside fenced code blocks, inline code removed."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(FENCE):
            fenced = not fenced
        elif not fenced:
            yield re.sub(r"`[^`]*`", "", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def sections(text: str) -> list[Section]:
    """The headings of a Markdown text (code blocks' ``#`` lines are not), with their
    anchors (a repeated heading numbered ``-1``, ``-2``...) and the text under each."""
    found: list[Section] = []
    anchors: set[str] = set()
    heading: tuple[int, str, str] | None = None
    lines: list[str] = []
    fenced = False

    def close() -> None:
        if heading is not None:
            found.append(Section(*heading, body="\n".join(lines).strip("\n")))

    for line in text.splitlines():
        if line.lstrip().startswith(FENCE):
            fenced = not fenced
        match = None if fenced else HEADING.match(line)
        if match is None:
            lines.append(line)
            continue
        close()
        base = slug(match[2])
        name, count = base, 0
        while name in anchors:
            count += 1
            name = f"{base}-{count}"
        anchors.add(name)
        heading, lines = (len(match[1]), match[2], name), []
    close()
    return found


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings."""
    return {section.anchor for section in sections(path.read_text())}


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file's prose (not of its code)."""
    return [target for line in prose_lines(path.read_text()) for target in LINK.findall(line)]
