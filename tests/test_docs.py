"""The user's documentation stands on its own: a short README, lines that fit a screen, and every link it and docs/
make pointing at something in the repository."""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, line) of a page outside fenced code blocks and tables."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("|"):
            out.append((number, line))
    return out


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for _, line in _prose(path) if line.startswith("#")}


def test_readme_fits_a_few_screens():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_prose_lines_fit(page):
    long = [(n, len(line)) for n, line in _prose(page) if len(line) > 120]
    assert not long, f"{page.name}: lines over 120 characters outside code and tables: {long}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_point_into_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text, f"{page.name} depends on a folder beside the repository"
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{page.name} links {target}: no such file"
        assert REPO in linked.parents or linked == REPO, f"{page.name} links {target}, outside the repository"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{page.name} links {target}: no such heading"


def test_every_doc_page_is_listed_in_the_readme():
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_counter_is_documented():
    from specjax.eval.systems import COUNTER_KEYS

    table = (REPO / "docs" / "results.md").read_text()
    missing = [key for key in COUNTER_KEYS if f"`{key}`" not in table]
    assert not missing, f"counters docs/results.md does not describe: {missing}"
