"""The README's configuration tables and the settings Keel reads cannot drift apart: every setting has a row, and
every row names a setting."""

from __future__ import annotations

import re
from pathlib import Path

from models.settings import Settings

README = Path(__file__).resolve().parents[2] / "README.md"


def _names_in(cell: str) -> list[str]:
    """The variables a row's first cell names: ``KEEL_A_B`` and ``KEEL_A_B` / `..._C`` (``KEEL_A_C``: the short form
    replaces the full name from its first word on, or only the last word when that word is not in the name)."""
    names: list[str] = []
    for token in re.findall(r"`([^`]+)`", cell):
        if token.startswith("KEEL_"):
            names.append(token)
        elif token.startswith("..._") and names:
            tail = token.removeprefix("..._").split("_")
            words = names[0].split("_")
            cut = max((i for i, w in enumerate(words) if w == tail[0]), default=len(words) - 1)
            names.append("_".join(words[:cut] + tail))
    return names


def _documented() -> set[str]:
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `KEEL_")]
    return {name for row in rows for name in _names_in(row.split("|")[1])}


def _settings() -> set[str]:
    prefix = str(Settings.model_config.get("env_prefix", "")).upper()
    return {f"{prefix}{name.upper()}" for name in Settings.model_fields}


def test_the_short_form_of_a_row_expands_to_the_full_names() -> None:
    assert _names_in("`KEEL_OUTBOX_BACKOFF_SECONDS` / `..._MAX_SECONDS`") == [
        "KEEL_OUTBOX_BACKOFF_SECONDS",
        "KEEL_OUTBOX_BACKOFF_MAX_SECONDS",
    ]
    assert _names_in("`KEEL_ALERT_RECOVERY_RATE_MIN` / `..._RECOVERY_MIN_FAILURES`")[1] == (
        "KEEL_ALERT_RECOVERY_MIN_FAILURES"
    )


def test_every_setting_has_a_row_in_the_readme() -> None:
    missing = sorted(_settings() - _documented())
    assert not missing, f"settings without a row in README.md's configuration tables: {missing}"


def test_every_row_names_a_setting_keel_reads() -> None:
    unknown = sorted(_documented() - _settings())
    assert not unknown, f"README.md rows naming no setting: {unknown}"
