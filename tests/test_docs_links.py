"""The front page stays a front page and the documentation's links lead somewhere.

README.md holds at most 150 lines; every relative Markdown link of README.md and
docs/*.md names a file that exists and, with a ``#anchor``, a heading of that file
(GitHub's slugs: lowercase, punctuation other than ``-`` and ``_`` removed, spaces to
``-``, a repeated heading numbered ``-1``, ``-2``...); every docs/ page but the results
pages is linked from README.md, and RESULTS.md (the current numbers) links its dated log.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_pages import anchors, links, slug

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 150


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` whose file or heading does not exist, with why."""
    broken = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto: ...: not a file of the repository
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    return broken


def test_readme_is_a_front_page():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading(path):
    assert not broken_links(path)


def test_readme_links_every_docs_page():
    linked = {
        (README.parent / target.partition("#")[0]).resolve()
        for target in links(README)
        if target.partition("#")[0]
    }
    results_pages = {"RESULTS.md", "results-history.md"}
    missing = [p.name for p in DOCS if p.name not in results_pages and p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_the_results_page_links_its_dated_log():
    results = REPO / "docs" / "RESULTS.md"
    assert "results-history.md" in {target.partition("#")[0] for target in links(results)}


def test_slugs_follow_githubs_rules():
    assert slug("Elastic resume: another number of GPUs, or one process") == (
        "elastic-resume-another-number-of-gpus-or-one-process"
    )
    assert slug("Environment on the other nodes: `.deepspeed_env`") == (
        "environment-on-the-other-nodes-deepspeed_env"
    )
    assert slug("Effective descent quality (EDQ)") == "effective-descent-quality-edq"


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## A section: here\n\n"
        "```text\n# not a heading\n```\n\n## A section: here\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [fine too](other.md#a-section-here) [repeat](other.md#a-section-here-1)\n"
        "[same page](#page) [web](https://example.org/x.md) `[in code](gone.md)`\n"
        "```\n[in a block](gone.md)\n```\n"
        "[gone](missing.md) [no heading](other.md#not-a-heading) [here](#nowhere)\n"
    )
    assert broken_links(page) == [
        f"missing.md: no file {tmp_path.resolve() / 'missing.md'}",
        "other.md#not-a-heading: no heading #not-a-heading in other.md",
        "#nowhere: no heading #nowhere in page.md",
    ]
