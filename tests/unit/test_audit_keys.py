"""The journal's key ring: how it is configured, refused, generated for development, and kept secret."""

from __future__ import annotations

import json
import logging
import stat
import threading
from pathlib import Path

import pytest

from agents.core.redaction import MASK, RedactingFilter, clear_secrets, register_settings, secrets_of
from models.audit_keys import DEV_KEY_FILE, AuditKeyMissing, AuditKeys, audit_keys_for, development_key
from models.settings import BadConfiguration, Settings, load_settings

SECRET = "s3cret-audit-key-material-0123456789-abcdef"  # 43 bytes
OTHER = "another-audit-key-material-0123456789-zyxwvu"
SERVERS = {"KEEL_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none", "KEEL_BROKER_URL": "redis://127.0.0.1:1/0"}


@pytest.fixture(autouse=True)
def _no_audit_key_from_the_suite(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The suite sets a key for every process; these tests set their own (or none), with a home of their own.
    monkeypatch.delenv("KEEL_AUDIT_KEYS", raising=False)
    monkeypatch.delenv("KEEL_AUDIT_KEY_ID", raising=False)
    monkeypatch.setenv("KEEL_HOME", str(tmp_path / ".keel"))


def _refused(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(BadConfiguration) as refused:
        load_settings()
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_a_ring_of_one_key_needs_no_key_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_AUDIT_KEYS", json.dumps({"2027-01": SECRET}))
    keys = audit_keys_for(load_settings())
    assert (keys.current, keys.ids) == ("2027-01", ("2027-01",))


def test_key_id_names_the_key_new_events_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_AUDIT_KEYS", json.dumps({"old": SECRET, "new": OTHER}))
    monkeypatch.setenv("KEEL_AUDIT_KEY_ID", "new")
    keys = audit_keys_for(load_settings())
    assert (keys.current, keys.ids) == ("new", ("new", "old"))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"KEEL_AUDIT_KEYS": json.dumps({"k1": "too-short-secret"})},
            "bad configuration: KEEL_AUDIT_KEYS: key 'k1': its secret must be at least 32 bytes",
        ),
        (
            {"KEEL_AUDIT_KEYS": json.dumps({"bad id!": SECRET})},
            "bad configuration: KEEL_AUDIT_KEYS: key id 'bad id!': use 1 to 64 letters, digits and . _ -",
        ),
        (
            {"KEEL_AUDIT_KEYS": json.dumps({"k1": SECRET}), "KEEL_AUDIT_KEY_ID": "k2"},
            "bad configuration: KEEL_AUDIT_KEY_ID: 'k2' is not a key of KEEL_AUDIT_KEYS (its keys: k1)",
        ),
        (
            {"KEEL_AUDIT_KEYS": json.dumps({"k1": SECRET, "k2": OTHER})},
            "bad configuration: KEEL_AUDIT_KEY_ID: required when KEEL_AUDIT_KEYS holds several keys (k1, k2)",
        ),
        (
            {"KEEL_AUDIT_KEY_ID": "k1"},
            "bad configuration: KEEL_AUDIT_KEY_ID: set, but KEEL_AUDIT_KEYS is empty",
        ),
        (
            {"KEEL_AUDIT_KEYS": json.dumps({"k1": 12345678901234567890123456789012345})},
            "bad configuration: KEEL_AUDIT_KEYS: k1: Input should be a valid string",
        ),
        ({"KEEL_AUDIT_KEYS": "{not json"}, "bad configuration: KEEL_AUDIT_KEYS: must be JSON"),
        (
            {"KEEL_ENVIRONMENT": "production", **SERVERS},
            "bad configuration: KEEL_AUDIT_KEYS: production needs the journal's key ring",
        ),
    ],
)
def test_a_missing_short_or_unknown_key_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    said = _refused(monkeypatch, **env)
    assert said.startswith(message), said
    assert SECRET not in said and OTHER not in said and "too-short-secret" not in said


def test_production_starts_with_a_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"KEEL_ENVIRONMENT": "production", **SERVERS}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KEEL_AUDIT_KEYS", json.dumps({"prod-1": SECRET}))
    assert audit_keys_for(load_settings()).current == "prod-1"


def test_a_development_key_is_generated_once_readable_by_its_owner_only(tmp_path: Path) -> None:
    home = tmp_path / ".keel"
    first = audit_keys_for(Settings(home=home))
    path = home / DEV_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first.current.startswith("dev-")
    assert audit_keys_for(Settings(home=home)) == first, "the second process uses the same key"
    assert [p.name for p in home.iterdir()] == [DEV_KEY_FILE], "no draft left behind"
    assert audit_keys_for(Settings(home=tmp_path / "elsewhere")).current != first.current, "another home, another id"


def test_processes_starting_together_agree_on_one_development_key(tmp_path: Path) -> None:
    home = tmp_path / ".keel"
    got: list[AuditKeys] = []
    threads = [threading.Thread(target=lambda: got.append(development_key(home))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 8 and all(keys == got[0] for keys in got)


def test_a_damaged_development_key_is_named_not_replaced(tmp_path: Path) -> None:
    home = tmp_path / ".keel"
    home.mkdir()
    (home / DEV_KEY_FILE).write_text("{oops")
    with pytest.raises(AuditKeyMissing, match=r"audit-key.json is not the audit key Keel generated"):
        development_key(home)
    assert (home / DEV_KEY_FILE).read_text() == "{oops"


def test_a_ring_never_shows_its_secrets() -> None:
    keys = AuditKeys.of({"k1": SECRET}, "k1")
    assert SECRET not in repr(keys) and SECRET not in str(keys) and "k1" in repr(keys)
    assert SECRET not in repr(Settings(audit_keys={"k1": SECRET}))  # type: ignore[dict-item]
    with pytest.raises(AuditKeyMissing, match=r"the key ring has no key 'k2' \(its keys: k1\)"):
        AuditKeys.of({"k1": SECRET}, "k2")


def test_audit_secrets_are_masked_in_every_log_line(tmp_path: Path) -> None:
    settings = Settings(audit_keys={"k1": SECRET, "k2": OTHER}, audit_key_id="k1")  # type: ignore[arg-type]
    assert {SECRET, OTHER} <= set(secrets_of(settings))
    development = Settings(home=tmp_path / ".keel")
    assert secrets_of(development) == [] and not (tmp_path / ".keel").exists(), "reading secrets generates nothing"
    generated = audit_keys_for(development)  # a process opening the database
    assert [s.decode() for s in generated.secrets.values()] == secrets_of(development)
    try:
        register_settings(settings)
        record = logging.LogRecord("keel", logging.ERROR, __file__, 1, "key was %s", (SECRET,), None)
        RedactingFilter().filter(record)
        assert record.getMessage() == f"key was {MASK}"
    finally:
        clear_secrets()


def test_a_stored_digest_that_is_not_ascii_is_a_mismatch_not_a_crash() -> None:
    keys = AuditKeys.of({"k1": SECRET}, "k1")
    good = keys.mac("k1", ["tag", 1])
    assert keys.verifies("k1", ["tag", 1], good)
    for tampered in (good[:-1] + "é", "ü" * len(good), good[:-1] + "\udc80"):
        assert not keys.verifies("k1", ["tag", 1], tampered)
