"""`keel up`'s view of its servers: one line per change of state, a bounded outage, no credentials in its lines."""

from __future__ import annotations

from agents.cli.supervisor import ServerHealth, where


def test_one_line_per_change_of_state_and_giving_up_only_after_a_whole_outage() -> None:
    health = ServerHealth("Redis", "redis://:secret@127.0.0.1:6390/0", give_up_after=30)
    assert health.observe(0, None) is None
    down = health.observe(1, "Connection refused")
    assert down is not None and down.startswith(
        "keel up: Redis at 127.0.0.1:6390/0 is unreachable (Connection refused)"
    )
    assert health.observe(2, "Timeout") is None, "still down: no new line"
    assert not health.gave_up(30)
    assert health.observe(20, None) == "keel up: Redis at 127.0.0.1:6390/0 answers again (after 19s)"
    assert health.observe(21, None) is None
    assert health.observe(40, "refused") is not None
    assert not health.gave_up(69), "the clock restarts with each outage"
    assert health.gave_up(70)


def test_server_lines_never_show_credentials() -> None:
    assert where("postgresql+psycopg://keel:hunter2@db.internal:5432/keel") == "db.internal:5432/keel"
    assert where("redis://:hunter2@127.0.0.1:6379/3") == "127.0.0.1:6379/3"
    assert where("postgresql://postgres:@/postgres?host=/srv/.keel/postgres") == (
        "postgres on the socket in /srv/.keel/postgres"
    )
