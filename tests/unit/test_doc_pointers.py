"""A comment that points at the documentation (``docs/….md#section``) points at a page and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POINTER = re.compile(r"docs/[\w./-]+\.md(?:#[\w-]+)?")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def slug(heading: str) -> str:
    """The anchor GitHub and MkDocs give a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def pointers() -> list[tuple[str, str]]:
    found = []
    for folder in ("agents", "tasks", "models", "bench", "alembic"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for pointer in POINTER.findall(path.read_text()):
                found.append((str(path.relative_to(ROOT)), pointer))
    return found


def test_the_code_points_at_the_explanation_pages() -> None:
    assert len({p for _, p in pointers() if p.startswith("docs/explanation/")}) >= 20


def test_every_pointer_names_a_page_and_a_heading_that_exist() -> None:
    broken = []
    for source, pointer in pointers():
        page, _, anchor = pointer.partition("#")
        path = ROOT / page
        if not path.is_file():
            broken.append(f"{source}: {pointer} (no such page)")
        elif anchor and anchor not in {slug(h) for h in HEADING.findall(path.read_text())}:
            broken.append(f"{source}: {pointer} (no such heading)")
    assert broken == []


TEST_REFERENCE = re.compile(r"\b(test_\w+\.py)(?:::(test_\w+))?")


def test_every_test_the_docs_name_exists() -> None:
    """A page that says which test holds a rule (docs/choke-points.md, the runbook) names a test that exists."""
    files = {path.name: path for path in (ROOT / "tests").rglob("test_*.py")}
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for file, name in TEST_REFERENCE.findall(page.read_text()):
            if file not in files:
                missing.append(f"{page.name}: {file}")
            elif name and not re.search(rf"^(async )?def {name}\(", files[file].read_text(), re.M):
                missing.append(f"{page.name}: {file}::{name}")
    assert missing == []
