"""What the documentation shows is what Keel has: every Python block in README.md and docs/ compiles, every `keel …`
command in a shell block parses against the real click commands (a command or option that does not exist fails
here), every relative link points at a page (and heading) that exists, and the KPI page names every KPI `keel kpi`
prints. The examples that are run for real (against a database) are run by their integration tests."""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import click
import pytest

import agents.jobs.handlers as handlers
import agents.runtime.tools as tools
from agents.cli.group import cli
from agents.observability.kpis import report_lines
from models.kpi_sql import Kpis
from models.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
SHELLS = {"sh", "bash", "console", "shell"}
#: A placeholder a reader replaces: <agent>, $TOKEN, ${KEEL_X}, AGENT, N.
PLACEHOLDER = re.compile(r"<[^>]*>|\$\{?\w+\}?|^[A-Z][A-Z0-9_]*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(langs: set[str]) -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match["lang"] in langs:
                line = text.count("\n", 0, match.start()) + 1
                body = textwrap.dedent(match["body"]) if match["indent"] else match["body"]
                found.append(Block(page, line, match["lang"], body))
    return found


def test_the_pages_have_examples_to_check() -> None:
    assert len(blocks({"python"})) >= 15 and len(blocks(SHELLS)) >= 25


@pytest.mark.parametrize("block", blocks({"python"}), ids=str)
def test_every_python_block_compiles(block: Block) -> None:
    compile(block.body, str(block), "exec")


DEFINING = [b for b in blocks({"python"}) if ("@handler(" in b.body or "@tool(" in b.body) and "Client" not in b.body]


@pytest.mark.parametrize("block", DEFINING, ids=str)
def test_every_handler_and_tool_example_registers(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block that defines handlers or tools runs as a module would (into registries of this test's own): the
    decorators accept what the page passes them."""
    own = handlers.Registry()
    monkeypatch.setattr(handlers, "registry", own)
    monkeypatch.setattr(tools, "_TOOLS", {})
    exec(compile(block.body, str(block), "exec"), {"__name__": "docs_example"})
    named = re.findall(r'@(handler|tool)\("([\w-]+)"', block.body)
    assert named and all(own.get(n) if kind == "handler" else tools.by_name(n) for kind, n in named)


def keel_commands(block: Block) -> list[list[str]]:
    """Each `keel …` (or `.venv/bin/keel …`) command of a shell block as its arguments: continuation lines joined,
    comments, prompts and leading VAR=value assignments dropped, `&&` / `;` / `|` chains split."""
    found = []
    for raw in block.body.replace("\\\n", " ").splitlines():
        line = raw.strip().removeprefix("$ ")
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError as exc:  # an unbalanced quote: not a command line (output, a JSON fragment)
            assert "keel " not in line.split("#")[0], f"{block}: cannot parse {line!r}: {exc}"
            continue
        command: list[str] = []
        for token in [*tokens, ";"]:
            if token and set(token) <= set(";&|"):
                while command and re.fullmatch(r"[A-Za-z_]\w*=.*", command[0]):
                    command.pop(0)
                if command and (command[0] == "keel" or command[0].endswith("/keel")):
                    found.append(command[1:])
                command = []
            else:
                command.append(token)
    return found


COMMANDS = [(block, args) for block in blocks(SHELLS) for args in keel_commands(block)]


def parse(args: list[str]) -> None:
    """Parse ``keel ARGS`` with click's own parser, resolving each group's subcommand, without running anything."""
    command: click.Command = cli
    name, ctx = "keel", None
    while True:
        if isinstance(command, click.Group):
            at = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
            ctx = command.make_context(name, args if at is None else args[: at + 1], parent=ctx)
            if at is None:
                return
            found = command.get_command(ctx, args[at])
            if found is None:
                raise click.UsageError(f"no such command {args[at]!r} in `{ctx.command_path}`")
            command, name, args = found, args[at], args[at + 1 :]
        else:
            command.make_context(name, list(args), parent=ctx, resilient_parsing=False)
            return


def test_the_pages_name_keel_commands() -> None:
    assert len(COMMANDS) >= 30
    assert ["demo"] in [args for _, args in COMMANDS]  # the README's first command


@pytest.mark.parametrize(("block", "args"), COMMANDS, ids=[f"{b}: keel {' '.join(a)}"[:120] for b, a in COMMANDS])
def test_every_keel_command_in_the_docs_parses(block: Block, args: list[str]) -> None:
    placeholders = [a for a in args if PLACEHOLDER.search(a)]
    dummy = [PLACEHOLDER.sub("x", a) if PLACEHOLDER.search(a) and not a.startswith("-") else a for a in args]
    try:
        parse(dummy)
    except click.exceptions.Exit:
        pass  # --help, --version
    except click.MissingParameter as exc:
        pytest.fail(f"{block}: keel {' '.join(args)}: {exc.format_message()}")
    except click.BadParameter as exc:
        # A value a reader fills in may not fit the option's type as written; a file the page had them write first
        # (--script replies.json) is not here.
        if not placeholders and "does not exist" not in exc.format_message():
            pytest.fail(f"{block}: keel {' '.join(args)}: {exc.format_message()}")
    except click.UsageError as exc:
        pytest.fail(f"{block}: keel {' '.join(args)}: {exc.format_message()}")


def test_the_parser_refuses_what_keel_does_not_have() -> None:
    for args in (["submit", "a", "r", "--input", "{}", "--no-such-option"], ["no-such-command"], ["agent", "nope"]):
        with pytest.raises(click.UsageError):
            parse(args)
    with pytest.raises(click.MissingParameter):
        parse(["approve", "a"])  # --revision is required


# --- links --------------------------------------------------------------------------------------------------------

#: Files docs/hooks.py writes into the site at build time, not kept in the repository.
GENERATED = {ROOT / "docs" / "reference" / "openapi.json"}
LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's toc): markup and punctuation dropped, lower case,
    spaces and hyphens as one hyphen."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\s-]", "", text.encode("ascii", "ignore").decode()).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in HEADING.findall(text)}


def test_every_relative_link_points_at_a_page_and_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for target in LINK.findall(text):
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() and linked not in GENERATED:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


# --- the KPI page -------------------------------------------------------------------------------------------------


def test_the_kpi_page_names_every_kpi_keel_kpi_prints() -> None:
    maps = {"suppressed_duplicates", "attempt_failures", "counters"}
    kpis = SimpleNamespace(**{f.name: {} if f.name in maps else 0 for f in fields(Kpis)})
    page = (ROOT / "docs" / "reference" / "kpis.md").read_text()
    missing = [label for label, _ in report_lines(kpis) if f"| {label} |" not in page]  # type: ignore[arg-type]
    assert missing == []


# --- settings -----------------------------------------------------------------------------------------------------

VARIABLE = re.compile(r"(?<![A-Za-z0-9_])KEEL_[A-Z0-9_]+")
#: Names the pages use that are not settings: the HttpClient example's own variables, and a placeholder.
NOT_SETTINGS = {"KEEL_API_URL", "KEEL_API_TOKEN", "KEEL_X"}


def test_every_keel_variable_the_docs_name_is_a_setting() -> None:
    """A page that names a KEEL_ variable names one Keel reads (or compose's own, from .env.example); a name ending
    in `_` is a family of settings (`KEEL_ALERT_…`)."""
    settings = {f"KEEL_{name.upper()}" for name in Settings.model_fields}
    compose = set(VARIABLE.findall((ROOT / ".env.example").read_text() + (ROOT / "compose.yaml").read_text()))
    unknown = []
    for page in PAGES:
        for name in sorted(set(VARIABLE.findall(page.read_text()))):
            known = name in settings or name in compose or name in NOT_SETTINGS
            if not known and not (name.endswith("_") and any(s.startswith(name) for s in settings)):
                unknown.append(f"{page.relative_to(ROOT)}: {name}")
    assert unknown == []


def test_every_make_target_the_docs_name_exists() -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = {(page, t) for page in PAGES for t in re.findall(r"`make ([\w-]+)", page.read_text())}
    assert sorted(f"{page.relative_to(ROOT)}: make {t}" for page, t in named if t not in targets) == []
