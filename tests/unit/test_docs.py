"""The README is a front page and every page it or the docs link to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for target, _ in LINK.findall(page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in _pages()[1:] if f"docs/{p.name}" not in readme]
    assert not missing, missing
