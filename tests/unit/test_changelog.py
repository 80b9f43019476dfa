"""CHANGELOG.md keeps the shape a user reads: releases newest first, Keep a Changelog sections, one line per entry."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"
RELEASE = re.compile(r"## (\d+)\.(\d+)\.(\d+) — (\d{4}-\d{2}-\d{2})")
# Keep a Changelog 1.1.0's section names, in the order a release lists them.
SECTIONS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
MAX_ENTRY = 200


@dataclass
class Release:
    heading: str
    line: int
    sections: dict[str, list[str]] = field(default_factory=dict)
    stray: list[tuple[int, str]] = field(default_factory=list)


def releases() -> list[Release]:
    """The file's releases in order, each with its sections' lines (blank lines dropped)."""
    found: list[Release] = []
    section: str | None = None
    for number, line in enumerate(CHANGELOG.read_text().splitlines(), start=1):
        if line.startswith("## "):
            found.append(Release(line, number))
            section = None
        elif line.startswith("### "):
            assert found, f"line {number}: a section before any release: {line!r}"
            section = line[4:]
            assert section not in found[-1].sections, f"line {number}: {section!r} twice in {found[-1].heading!r}"
            found[-1].sections[section] = []
        elif found and line.strip():
            if section is None:
                found[-1].stray.append((number, line))
            else:
                found[-1].sections[section].append(line)
    return found


def test_the_file_starts_with_its_title() -> None:
    assert CHANGELOG.read_text().splitlines()[0] == "# Changelog"


def test_unreleased_comes_first_then_versions_newest_first() -> None:
    found = releases()
    assert found, "no release headings"
    assert found[0].heading == "## Unreleased"
    versions, dates = [], []
    for release in found[1:]:
        match = RELEASE.fullmatch(release.heading)
        assert match, f"line {release.line}: not '## X.Y.Z — YYYY-MM-DD': {release.heading!r}"
        versions.append(tuple(int(part) for part in match.groups()[:3]))
        dates.append(date.fromisoformat(match.group(4)))
    assert versions, "no released versions"
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions), versions
    assert dates == sorted(dates, reverse=True), "a release is dated after a newer one"


def test_sections_are_the_allowed_ones_in_order() -> None:
    for release in releases():
        names = list(release.sections)
        unknown = [name for name in names if name not in SECTIONS]
        assert not unknown, f"{release.heading}: sections {unknown} are not among {SECTIONS}"
        assert names == sorted(names, key=SECTIONS.index), f"{release.heading}: {names} out of order"
        assert all(release.sections.values()), f"{release.heading}: an empty section"
        if release.heading != "## Unreleased":
            assert names, f"{release.heading}: no entries"


def test_every_entry_is_one_line() -> None:
    for release in releases():
        assert not release.stray, f"{release.heading}: text outside a section: {release.stray}"
        for name, lines in release.sections.items():
            for line in lines:
                where = f"{release.heading} / {name}"
                assert line.startswith("- ") and line[2:].strip(), f"{where}: not a one-line entry: {line!r}"
                assert len(line) <= MAX_ENTRY, f"{where}: {len(line)} characters (at most {MAX_ENTRY}): {line!r}"


def test_no_other_headings() -> None:
    for number, line in enumerate(CHANGELOG.read_text().splitlines(), start=1):
        if line.startswith("#"):
            assert number == 1 or line.startswith(("## ", "### ")), f"line {number}: {line!r}"
            assert not line.startswith("####"), f"line {number}: {line!r}"


def test_the_package_says_the_newest_release_is_its_version() -> None:
    """`keel --version` and the wheel's name say the release the changelog lists last, not a number of their own."""
    pyproject = tomllib.loads((CHANGELOG.parent / "pyproject.toml").read_text())
    newest = next(r.heading for r in releases() if r.heading != "## Unreleased")
    assert newest.startswith(f"## {pyproject['project']['version']} — "), (newest, pyproject["project"]["version"])
