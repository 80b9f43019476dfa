"""The documentation site builds with ``mkdocs build --strict`` from this repository alone, and its reference pages,
generated from the code at build time (docs/hooks.py, mkdocs-click, mkdocstrings), name every command, setting, HTTP
path, problem type and metric Keel has."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import click
import pytest

from agents.cli.reference import keel
from agents.ingress import problems
from agents.observability.names import ALL
from models.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
#: Where a page loads something from: a script, a stylesheet or an icon, an image, a CSS import or url().
LOADS = re.compile(
    r"<script\b[^>]*\bsrc=[\"']([^\"']+)|<link\b[^>]*\bhref=[\"']([^\"']+)|<img\b[^>]*\bsrc=[\"']([^\"']+)"
    r"|@import\s+(?:url\()?[\"']?([^\"')\s;]+)|url\(\s*[\"']?([^\"')\s]+)",
    re.I,
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(built)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return built


def text_of(page: Path) -> str:
    """A built page's text: tags dropped, entities decoded (a setting's name is broken up by <wbr> tags)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def command_paths(command: click.Command, path: tuple[str, ...]) -> Iterator[str]:
    yield " ".join(path)
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from command_paths(sub, (*path, name))


def test_the_cli_reference_shows_every_command(site: Path) -> None:
    page = text_of(site / "reference" / "cli" / "index.html")
    paths = list(command_paths(keel, ("keel",)))
    assert {"keel serve", "keel worker", "keel beat", "keel agent create", "keel docs phases"} <= set(paths)
    assert [path for path in paths if path not in page] == []


def test_the_settings_reference_shows_every_setting(site: Path) -> None:
    page = text_of(site / "reference" / "settings" / "index.html")
    missing = [f"KEEL_{name.upper()}" for name in Settings.model_fields if f"KEEL_{name.upper()}" not in page]
    assert missing == []


def test_the_http_reference_shows_every_path_of_the_openapi_document(site: Path) -> None:
    document = json.loads((site / "reference" / "openapi.json").read_text())
    page = text_of(site / "reference" / "http" / "index.html")
    assert "/v1/agents/{agent}/requests" in document["paths"]
    assert [path for path in document["paths"] if path not in page] == []
    operations = [op for item in document["paths"].values() for op in item.values()]
    assert [op["summary"] for op in operations if op["summary"] not in page] == []


def test_the_problem_types_and_metrics_are_listed(site: Path) -> None:
    page = text_of(site / "reference" / "problems" / "index.html")
    assert [k.type for k in problems.all_kinds().values() if k.type not in page] == []
    page = text_of(site / "reference" / "metrics" / "index.html")
    assert [m.name for m in ALL if m.name not in page] == []


def test_the_python_reference_documents_what_a_user_calls(site: Path) -> None:
    page = text_of(site / "reference" / "python" / "index.html")
    for name in ("Client", "HttpClient", "handler", "JobContext", "tool", "KeelAgent", "KeelGraph", "StaleRevision"):
        assert f"\n{name}\n" in page or f" {name}\n" in page, name
    assert ":class:`" not in page and ":func:`" not in page  # Sphinx roles are rendered as code (docs/griffe_roles.py)


def test_nothing_is_loaded_from_another_host(site: Path) -> None:
    """No script, stylesheet, font, image or CSS import of the site comes from the network: it reads offline."""
    remote = []
    for file in sorted([*site.rglob("*.html"), *site.rglob("*.css")]):
        for found in LOADS.finditer(file.read_text(errors="replace")):
            target = next(group for group in found.groups() if group)
            if urlsplit(target).scheme in ("http", "https") or target.startswith("//"):
                remote.append(f"{file.relative_to(site)}: {target}")
    assert remote == []
    assert (site / "assets" / "javascripts").is_dir()  # the theme's scripts ship with the site
    # A diagram the theme would draw fetches Mermaid's script from a CDN at run time: diagrams stay code blocks.
    assert [str(f.relative_to(site)) for f in site.rglob("*.html") if 'class="mermaid"' in f.read_text()] == []
