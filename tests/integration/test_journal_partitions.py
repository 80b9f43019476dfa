"""The journal partitioned by month (migration 0017, docs/audit-retention.md): the current table became the partition
``audit.journal_legacy`` without a row copied; the guards on the parent keep ``id`` and ``(agent_id, seq)`` unique
across months whoever inserts; the application role may create future months of a fixed shape and nothing else."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest
from psycopg import sql

from agents.audit.verify import verify_and_record
from agents.client import Client
from agents.observability import alerts
from models import migrations, partitions_sql
from models.db import Database
from models.migrations import DowngradeRefused
from models.settings import Settings
from models.urls import libpq_url
from tasks.leader import LeaderDuties
from tests.support.audit import TEST_KEYS, clean_env
from tests.support.cli import run_keel
from tests.support.roles import RoledDatabase

pytestmark = pytest.mark.integration

PARTITION = re.compile(r"^journal_\d{4}_\d{2}$")
KEEL = str(Path(sys.executable).parent / "keel")


def connect(url: str, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq_url(url), autocommit=autocommit)


def digest(url: str) -> tuple[Any, ...]:
    """Every journal row, byte for byte, in id order."""
    with connect(url) as conn:
        row = conn.execute("SELECT count(*), md5(string_agg(j::text, '|' ORDER BY id)) FROM audit.journal j").fetchone()
    assert row is not None
    return tuple(row)


def partitions(url: str) -> dict[str, str]:
    """The journal's partitions and their bounds."""
    with connect(url) as conn:
        rows = conn.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i"
            " JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'audit.journal'::regclass ORDER BY 1"
        ).fetchall()
    return {str(r[0]): str(r[1]) for r in rows}


def history(db: Database) -> list[UUID]:
    """Several chains: transitions, side events (a rejection), an archive and a deleted agent."""
    client = Client(db)
    ids = []
    for name in ("alpha", "beta", "gamma"):
        agent = client.create_agent(name, actor="alice")
        client.submit(agent.id, f"r-{name}", {"prompt": "go"}, actor="alice")
        client.cancel(agent.id, actor="alice", reason="enough")
        ids.append(agent.id)
    with pytest.raises(Exception, match="revision"):
        client.cancel(ids[0], actor="bob", expected_revision=0)  # a rejection: a side event
    client.archive(ids[2], actor="alice")
    client.delete_agent(ids[2], actor="alice")
    return ids


def verified(db: Database) -> None:
    report = verify_and_record(db, "cli")
    assert report.ok, report


# --- the migration ---------------------------------------------------------------------------------------------


def test_the_migration_keeps_every_row_and_the_downgrade_restores_the_table(empty_db_url: str) -> None:
    migrations.upgrade(empty_db_url, "0016")
    db = Database(empty_db_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        with connect(empty_db_url) as conn:
            assert conn.execute("SELECT relkind FROM pg_class WHERE oid = 'audit.journal'::regclass").fetchone() == (
                "r",
            )
        # Events in several chains (a deleted agent's included), written at head, then down to 0016 and back: the
        # rows of the plain table are the rows the partitioned one starts with.
        migrations.upgrade(empty_db_url)
        ids = history(db)
        migrations.downgrade(empty_db_url, "0016")
        before = digest(empty_db_url)
        assert before[0] == 12
        with connect(empty_db_url) as conn:
            constraints = {
                r[0]
                for r in conn.execute("SELECT conname FROM pg_constraint WHERE conrelid = 'audit.journal'::regclass")
            }
            assert {"pk_journal", "uq_journal_agent_id_seq", "ck_journal_kind"} <= constraints
            identity = conn.execute(
                "SELECT attidentity FROM pg_attribute WHERE attrelid = 'audit.journal'::regclass AND attname = 'id'"
            ).fetchone()
            assert identity == ("a",)

        migrations.upgrade(empty_db_url)
        assert digest(empty_db_url) == before  # not a byte changed, not a row copied
        with connect(empty_db_url) as conn:
            assert conn.execute("SELECT relkind FROM pg_class WHERE oid = 'audit.journal'::regclass").fetchone() == (
                "p",
            )
            legacy = conn.execute("SELECT count(*) FROM audit.journal_legacy").fetchone()
            assert legacy == (before[0],)
            last = conn.execute("SELECT max(id) FROM audit.journal").fetchone()
        bounds = partitions(empty_db_url)
        assert bounds["journal_legacy"].startswith("FOR VALUES FROM (MINVALUE) TO ")
        assert len([n for n in bounds if PARTITION.match(n)]) == 3  # next month and the two after it
        verified(db)
        Client(db).submit(ids[1], "r-next", {"prompt": "again"}, actor="alice")
        with connect(empty_db_url) as conn:
            assert conn.execute("SELECT max(id) FROM audit.journal").fetchone() == (last[0] + 1,)  # type: ignore[index]
        verified(db)
        migrations.check(empty_db_url)
    finally:
        db.dispose()


def test_the_downgrade_copies_monthly_rows_back(empty_db_url: str) -> None:
    migrations.upgrade(empty_db_url)
    db = Database(empty_db_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        history(db)
    finally:
        db.dispose()
    month = sorted(n for n in partitions(empty_db_url) if PARTITION.match(n))[0]
    with connect(empty_db_url) as conn:  # a row in a monthly partition, put there by a superuser with triggers off
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            conn.execute(
                sql.SQL(
                    "INSERT INTO audit.journal SELECT nextval('audit.journal_id_seq'), agent_id, seq + 100, kind,"
                    " event, actor, request_id, from_phase, to_phase, revision, decision, details, lower_bound,"
                    " prev_hash, hash, key_id FROM audit.journal j, (SELECT {}::timestamptz AS lower_bound) b"
                    " ORDER BY id DESC LIMIT 1"
                ).format(sql.Literal(_lower(partitions(empty_db_url)[month])))
            )
        assert conn.execute(sql.SQL("SELECT count(*) FROM audit.{}").format(sql.Identifier(month))).fetchone() == (1,)
    before = digest(empty_db_url)
    migrations.downgrade(empty_db_url, "0016")
    assert digest(empty_db_url) == before


def _lower(bound: str) -> str:
    found = re.search(r"FROM \('([^']+)'\)", bound)
    assert found, bound
    return found.group(1)


def test_the_downgrade_is_refused_once_a_partition_was_archived(db_url: str) -> None:
    # 0018's own downgrade refuses while it records an archive (test_migrations); here 0017's check is tried alone:
    # a database at 0017 with the archive's table left behind holding a record.
    migrations.downgrade(db_url, "0017")
    before = digest(db_url)
    with connect(db_url) as conn:  # the archive's table, as `keel audit archive` will have left it
        conn.execute("CREATE TABLE audit.archived_partitions (partition text PRIMARY KEY)")
        conn.execute("INSERT INTO audit.archived_partitions VALUES ('journal_2026_01')")
    with pytest.raises(DowngradeRefused, match=r"1 journal partition.*archived"):
        migrations.downgrade(db_url, "0016")
    assert migrations.revision_at(db_url) == "0017"
    assert digest(db_url) == before


# --- the guards, as the application role -----------------------------------------------------------------------

_APPEND = (
    "INSERT INTO audit.journal ({id}agent_id, seq, kind, event, actor, revision, decision, details, at, prev_hash,"
    " hash) {overriding}VALUES ({value}%(agent)s, %(seq)s, 'rejected', 'approve', 'mallory', 0, 'x', '{{}}', {at},"
    " 'p', 'h') RETURNING id"
)


def append(
    cur: psycopg.Cursor[Any],
    agent: UUID,
    *,
    seq: int | None = None,
    id: int | None = None,
    at: str = "clock_timestamp()",
    move_head: bool = True,
) -> int:
    """Append an event to ``agent``'s chain by hand, in the caller's transaction: under the agent's lock, its head
    moved with it (unless ``move_head`` is False)."""
    row = cur.execute("SELECT journal_seq FROM agents WHERE id = %s FOR UPDATE", (agent,)).fetchone()
    assert row is not None
    seq = row[0] + 1 if seq is None else seq
    statement = _APPEND.format(
        id="" if id is None else "id, ",
        overriding="" if id is None else "OVERRIDING SYSTEM VALUE ",
        value="" if id is None else f"{int(id)}, ",
        at=at,
    )
    new = cur.execute(statement, {"agent": agent, "seq": seq}).fetchone()
    assert new is not None
    if move_head:
        cur.execute("UPDATE agents SET journal_seq = %s, journal_head = 'h' WHERE id = %s", (seq, agent))
    return int(new[0])


@pytest.fixture
def chain(roles_db: RoledDatabase) -> Iterator[tuple[RoledDatabase, UUID]]:
    db = Database(roles_db.app_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        agent = Client(db).create_agent("ledger", actor="alice")
        Client(db).submit(agent.id, "r-1", {"prompt": "go"}, actor="alice")
    finally:
        db.dispose()
    yield roles_db, agent.id


def test_an_appended_event_by_hand_passes_the_guards(chain: tuple[RoledDatabase, UUID]) -> None:
    rdb, agent = chain
    with connect(rdb.app_url, autocommit=False) as app:
        with app.transaction(), app.cursor() as cur:
            append(cur, agent)
    assert digest(rdb.url)[0] == 3


def test_an_id_of_ones_own_choosing_is_refused(chain: tuple[RoledDatabase, UUID]) -> None:
    rdb, agent = chain
    before = digest(rdb.url)
    with connect(rdb.url) as superuser:
        taken = superuser.execute("SELECT min(id), max(id) FROM audit.journal").fetchone()
        assert taken is not None
        # Even a superuser: an id drawn from the sequence by hand is not this row's.
        drawn = superuser.execute("SELECT nextval('audit.journal_id_seq')").fetchone()
        assert drawn is not None
        with superuser.transaction(), superuser.cursor() as cur:
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="id comes from the journal's sequence"):
                append(cur, agent, id=drawn[0])
    with connect(rdb.app_url, autocommit=False) as app:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            app.execute("SELECT nextval('audit.journal_id_seq')")  # the application draws no id itself
        app.rollback()
        for chosen in (taken[0], taken[1] + 1, taken[1] + 1000000):  # another month's id; the next; one far ahead
            with app.cursor() as cur:
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match="id comes from the journal's sequence"):
                    append(cur, agent, id=chosen)
            app.rollback()
        # After an append of its own in this session (the id the sequence drew last is this session's): refused too.
        with app.cursor() as cur:
            own = append(cur, agent)
            app.rollback()
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="id comes from the journal's sequence"):
                append(cur, agent, id=own)
        app.rollback()
    assert digest(rdb.url) == before


@pytest.mark.parametrize(
    "at",
    [
        "transaction_timestamp() - interval '1 second'",  # before its own transaction: a closed month, maybe
        "clock_timestamp() + interval '1 minute'",  # in the future
        "'2000-01-01T00:00:00Z'",
    ],
)
def test_a_time_outside_the_transaction_is_refused(chain: tuple[RoledDatabase, UUID], at: str) -> None:
    rdb, agent = chain
    before = digest(rdb.url)
    with connect(rdb.app_url, autocommit=False) as app, app.cursor() as cur:
        with pytest.raises(psycopg.errors.CheckViolation, match="database clock during its own transaction"):
            append(cur, agent, at=at)
    assert digest(rdb.url) == before


@pytest.mark.parametrize("offset", [0, 2, -1])
def test_an_event_not_next_of_its_chain_is_refused(chain: tuple[RoledDatabase, UUID], offset: int) -> None:
    rdb, agent = chain
    before = digest(rdb.url)
    with connect(rdb.url) as conn:
        head = conn.execute("SELECT journal_seq FROM agents WHERE id = %s", (agent,)).fetchone()
    assert head is not None
    with connect(rdb.app_url, autocommit=False) as app, app.cursor() as cur:
        with pytest.raises(psycopg.errors.UniqueViolation, match="not the next of its chain"):
            append(cur, agent, seq=head[0] + offset)
    assert digest(rdb.url) == before


def test_the_same_event_twice_in_one_transaction_is_refused(chain: tuple[RoledDatabase, UUID]) -> None:
    rdb, agent = chain
    before = digest(rdb.url)
    with connect(rdb.app_url, autocommit=False) as app, app.cursor() as cur:
        append(cur, agent, move_head=False)
        with pytest.raises(psycopg.errors.UniqueViolation):
            append(cur, agent, move_head=False)
    assert digest(rdb.url) == before


def test_an_event_left_past_the_head_is_refused_at_commit(chain: tuple[RoledDatabase, UUID]) -> None:
    rdb, agent = chain
    before = digest(rdb.url)
    with connect(rdb.app_url, autocommit=False) as app:
        with app.cursor() as cur:
            append(cur, agent, move_head=False)  # accepted for now: the head may still move in this transaction
        with pytest.raises(psycopg.errors.UniqueViolation, match="past the head of its chain"):
            app.commit()
    assert digest(rdb.url) == before
    # The chain goes on as before: its next event is still accepted.
    with connect(rdb.app_url, autocommit=False) as app, app.transaction(), app.cursor() as cur:
        append(cur, agent)


def test_every_append_path_passes_the_guards_as_the_application_role(roles_db: RoledDatabase) -> None:
    db = Database(roles_db.app_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        ids = history(db)  # create, submit, cancel, a rejection, archive, delete
        Client(db).submit(ids[0], "r-again", {"prompt": "again"}, actor="alice")
        verified(db)
    finally:
        db.dispose()


def test_an_agent_and_its_created_event_in_one_statement(roles_db: RoledDatabase) -> None:
    """Data-modifying CTEs do not see each other's rows; the guards' lookups run as the triggers fire, after the
    agent's row went in — so an agent and its first event may still be written in one statement."""
    with connect(roles_db.app_url, autocommit=False) as app, app.transaction():
        row = app.execute(
            "WITH a AS (INSERT INTO agents (name, journal_seq, journal_head) VALUES ('one-shot', 0, 'h0')"
            " RETURNING id), ev AS (INSERT INTO audit.journal (agent_id, seq, kind, event, actor, revision, decision,"
            " details, at, prev_hash, hash) SELECT id, 1, 'created', 'create', 'alice', 0, 'accepted', '{}',"
            " clock_timestamp(), 'h0', 'h1' FROM a RETURNING agent_id) SELECT agent_id FROM ev"
        ).fetchone()
        assert row is not None
        # The head moved in a statement of its own (the CTE's rows are invisible to a sibling UPDATE).
        app.execute("UPDATE agents SET journal_seq = 1, journal_head = 'h1' WHERE id = %s", (row[0],))


# --- partitions -------------------------------------------------------------------------------------------------


def test_the_application_cannot_truncate_detach_or_drop_a_partition(chain: tuple[RoledDatabase, UUID]) -> None:
    rdb, _ = chain
    before = digest(rdb.url)
    names = ["journal_legacy", *sorted(n for n in partitions(rdb.url) if PARTITION.match(n))]
    with connect(rdb.app_url) as app:
        for name in names:
            partition = sql.Identifier("audit", name)
            for statement in (
                sql.SQL("TRUNCATE {}").format(partition),
                sql.SQL("ALTER TABLE audit.journal DETACH PARTITION {}").format(partition),
                sql.SQL("DROP TABLE {}").format(partition),
                sql.SQL("DELETE FROM {}").format(partition),
                sql.SQL("INSERT INTO {} SELECT * FROM audit.journal LIMIT 1").format(partition),
            ):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    app.execute(statement)
    with connect(rdb.url) as owner:  # the owner may not truncate one either: each has its own trigger
        owner.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(rdb.names.owner)))
        for name in names:
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
                owner.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier("audit", name)))
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
            owner.execute("DELETE FROM audit.journal_legacy")  # the partition with rows: the cloned trigger holds
    assert digest(rdb.url) == before


def test_the_application_creates_only_future_months_of_the_fixed_shape(roles_db: RoledDatabase) -> None:
    before = partitions(roles_db.url)
    with connect(roles_db.app_url) as app:
        assert app.execute("SELECT * FROM audit.keel_ensure_partitions(3)").fetchall() == []  # the migration's
        created = [r[0] for r in app.execute("SELECT * FROM audit.keel_ensure_partitions(5)").fetchall()]
        assert len(created) == 2 and all(PARTITION.match(n) for n in created), created
        assert app.execute("SELECT * FROM audit.keel_ensure_partitions(5)").fetchall() == []  # idempotent
        for bad in (0, 13, -1):
            with pytest.raises(psycopg.errors.InvalidParameterValue, match="months_ahead"):
                app.execute("SELECT audit.keel_ensure_partitions(%s)", (bad,))
    after = partitions(roles_db.url)
    assert set(after) - set(before) == set(created)
    with connect(roles_db.url) as conn:
        start = conn.execute("SELECT date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'").fetchone()
        assert start is not None
        for name in created:
            lower = conn.execute("SELECT %s::timestamptz", (_lower(after[name]),)).fetchone()
            assert lower is not None and lower[0] > start[0]  # future months only
            shape = conn.execute(
                "SELECT pg_get_userbyid(c.relowner), c.relacl IS NULL,"
                " (SELECT array_agg(tgname ORDER BY tgname) FROM pg_trigger WHERE tgrelid = c.oid),"
                " (SELECT array_agg(pg_get_indexdef(indexrelid) ORDER BY 1) FROM pg_index WHERE indrelid = c.oid"
                "  AND indisunique)"
                " FROM pg_class c WHERE c.oid = %s::regclass",
                (f"audit.{name}",),
            ).fetchone()
            assert shape is not None
            owner, no_grants, triggers, unique = shape
            assert owner == roles_db.names.owner and no_grants
            assert {"journal_no_truncate", "journal_append_guard", "journal_no_update_delete"} <= set(triggers)
            assert any("(agent_id, seq)" in u for u in unique) and any("(id, at)" in u for u in unique)


def test_the_guards_hold_inside_a_new_month(roles_db: RoledDatabase) -> None:
    """Routing to a partition happens before the (cloned) guards: a partition by name is guarded as the parent is."""
    with connect(roles_db.url) as conn:
        triggers = conn.execute(
            "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_inherits i"
            " ON i.inhrelid = c.oid WHERE i.inhparent = 'audit.journal'::regclass AND t.tgname = 'journal_append_guard'"
        ).fetchone()
        assert triggers == (len(partitions(roles_db.url)),)


# --- who keeps the months ahead, and who notices when nobody does ----------------------------------------------


def test_the_leading_beat_keeps_the_months_ahead_from_its_first_tick(
    db: Database, raw: psycopg.Connection[Any]
) -> None:
    assert partitions_sql.months_ahead(db) == 3  # the migration's
    duties = LeaderDuties(
        db, Settings(audit_partition_months_ahead=5, audit_verify_interval_seconds=0), name="test-beat"
    )
    duties.tick(1)
    assert partitions_sql.months_ahead(db) == 5
    assert raw.execute("SELECT count(*) FROM beat_chores WHERE name = 'journal_partitions'").fetchone() == (1,)


def test_the_alert_fires_when_fewer_than_two_months_ahead_have_a_partition(
    db: Database, raw: psycopg.Connection[Any]
) -> None:
    assert alerts.measure(db, timedelta(minutes=5)).journal_months_ahead == 3
    last = sorted(n for n in partitions(_url(db)) if PARTITION.match(n))[-1]
    # Two months ahead dropped by the owner (as an archive never would: months ahead are empty and never archived).
    for name in sorted(n for n in partitions(_url(db)) if PARTITION.match(n))[1:]:
        raw.execute(sql.SQL("DROP TABLE audit.{}").format(sql.Identifier(name)))
    measured = alerts.measure(db, timedelta(minutes=5))
    assert measured.journal_months_ahead == 1
    verdict = alerts.journal_partitions(measured, alerts.Thresholds())
    assert verdict.firing and "partitions for 1 month(s) after this one" in verdict.summary
    assert partitions_sql.ensure_partitions(db, 3)[-1] == last  # what the runbook says to do
    assert not alerts.journal_partitions(alerts.measure(db, timedelta(minutes=5)), alerts.Thresholds()).firing


def _url(db: Database) -> str:
    return db.engine.url.render_as_string(hide_password=False)


def test_keel_audit_partitions_lists_bounds_and_counts_and_creates_months(client: Client, db_url: str) -> None:
    agent = client.create_agent("counted", actor="alice")
    client.submit(agent.id, "r-1", {"prompt": "go"}, actor="alice")
    env = {**clean_env(), "KEEL_DATABASE_URL": db_url}
    listed = run_keel(["audit", "partitions"], env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["partition", "from", "to", "events"]
    assert lines[1].startswith("journal_legacy") and "(everything before)" in lines[1] and lines[1].endswith(" 2")
    assert [line.split()[0] for line in lines[2:5]] == sorted(n for n in partitions(db_url) if PARTITION.match(n))
    assert all(line.endswith(" 0") for line in lines[2:5])
    assert lines[-1] == "3 whole month(s) after this one have a partition"
    made = run_keel(["audit", "partitions", "--create", "--months", "4", "--json"], env)
    assert made.returncode == 0, made.stderr
    report = json.loads(made.stdout)
    assert len(report["created"]) == 1 and report["months_ahead"] == 4
    assert report["partitions"][0] == {
        "partition": "journal_legacy",
        "from": None,
        "to": report["partitions"][1]["from"],
        "events": 2,
    }
    bad = run_keel(["audit", "partitions", "--months", "4"], env)
    assert bad.returncode == 2 and "--months goes with --create" in bad.stderr


def test_keel_db_roles_ends_idle_transactions_of_the_application_role(roles_db: RoledDatabase) -> None:
    with connect(roles_db.app_url) as app:
        assert app.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("5min",)
