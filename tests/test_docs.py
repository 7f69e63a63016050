"""docs/ stays inside its budget, and every relative link in the README and docs/*.md resolves to
a file of the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_FILES = 100
MAX_BYTES = 2_000_000
LINK = re.compile(r"\]\(([^()\s]+)\)")  # [text](target) and ![alt](target)
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_docs_inside_budget():
  files = [f for f in DOCS.rglob("*") if f.is_file()]
  size = sum(f.stat().st_size for f in files)
  assert len(files) <= MAX_FILES, f"docs/ holds {len(files)} files, budget {MAX_FILES}"
  assert size <= MAX_BYTES, f"docs/ holds {size} bytes, budget {MAX_BYTES}"


def _relative_links(page: Path) -> list[str]:
  return [target for target in LINK.findall(page.read_text())
          if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
  links = _relative_links(page)
  missing = [t for t in links if not (page.parent / t.split("#")[0]).resolve().is_file()]
  assert not missing, f"{page.relative_to(ROOT)}: links to missing files {missing}"


def test_link_pattern_finds_links():
  assert _relative_links(DOCS / "kernel.md")  # the pattern sees the results pages' links
