"""Every setting is documented in one place, the settings model, and the docs' settings reference is generated from
it (docs/hooks.py): a setting cannot lack its description or its row."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import get_args

from pydantic import SecretStr

from models.settings import Settings

HOOKS = Path(__file__).resolve().parents[2] / "docs" / "hooks.py"


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("keel_docs_hooks", HOOKS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows() -> dict[str, list[str]]:
    """The settings page's table rows by variable: its cells (type, default, description)."""
    page = hooks().settings_markdown().replace("<wbr>", "")
    found = {}
    for line in page.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if name := re.fullmatch(r"<code>(KEEL_\w+)</code>", cells[0]):
            found[name.group(1)] = cells[1:]
    return found


def test_every_setting_has_a_description() -> None:
    missing = [name for name, field in Settings.model_fields.items() if not (field.description or "").strip()]
    assert missing == []


def test_every_setting_has_a_row_with_its_description() -> None:
    table = rows()
    assert set(table) == {f"KEEL_{name.upper()}" for name in Settings.model_fields}
    for name, field in Settings.model_fields.items():
        assert table[f"KEEL_{name.upper()}"][2] == " ".join((field.description or "").split()).replace("|", "\\|")


def test_rows_show_types_bounds_and_defaults_and_never_a_secret() -> None:
    table = rows()
    assert table["KEEL_API_PORT"][:2] == ["integer, 1 to 65535", "`8000`"]
    assert table["KEEL_WORKER_POOL"][0] == "`threads` or `prefork` or `solo`"
    assert table["KEEL_DATABASE_URL"][1] == "unset"
    secrets = [name for name, field in Settings.model_fields.items() if SecretStr in _types(field.annotation)]
    assert {"slack_token", "audit_keys", "console_session_key"} <= set(secrets)
    assert [name for name in secrets if table[f"KEEL_{name.upper()}"][1] != "unset"] == []


def _types(annotation: object) -> set[object]:
    return {annotation, *(t for arg in get_args(annotation) for t in _types(arg))}
