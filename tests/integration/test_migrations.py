from __future__ import annotations

from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from agents.audit.ship import recorded_last_id
from models import alerts_sql, migrations
from models.db import Database
from models.migrations import DowngradeRefused
from models.urls import libpq_url
from tests.support.audit import TEST_KEYS

pytestmark = pytest.mark.integration


def _tables(url: str) -> set[str]:
    with psycopg.connect(libpq_url(url)) as conn:
        rows: list[Any] = conn.execute(
            "SELECT schemaname || '.' || tablename FROM pg_tables WHERE schemaname IN ('public', 'audit')"
        ).fetchall()
    return {r[0] for r in rows}


def test_upgrade_check_downgrade_upgrade(empty_db_url: str) -> None:
    migrations.upgrade(empty_db_url)
    assert {
        "public.agents",
        "public.requests",
        "public.jobs",
        "public.outbox",
        "public.api_tokens",
        "public.kpi_deltas",
        "public.kpi_rollups",
        "public.alert_episodes",
        "public.beat_terms",
        "public.beat_chores",
        "public.audit_verifications",
        "audit.journal",
        "audit.legacy_chains",
    } <= _tables(empty_db_url)
    migrations.check(empty_db_url)  # raises if models/tables.py and the migrated schema differ
    migrations.downgrade(empty_db_url, "base")
    assert _tables(empty_db_url) <= {"public.alembic_version"}
    migrations.upgrade(empty_db_url)
    migrations.check(empty_db_url)


def _guards(url: str) -> tuple[set[str], set[str]]:
    with psycopg.connect(libpq_url(url)) as conn:
        triggers = {r[0] for r in conn.execute("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal").fetchall()}
        checks = {
            r[0]
            for r in conn.execute(
                "SELECT conname FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace"
                " WHERE contype = 'c' AND nspname IN ('public', 'audit')"
            ).fetchall()
        }
    return triggers, checks


def test_triggers_and_check_constraints_survive_the_cycle(empty_db_url: str) -> None:
    """`alembic check` cannot see triggers or CHECK constraints: compare them with the model here."""
    from models.tables import metadata

    expected_checks = {
        str(constraint.name)
        for table in metadata.tables.values()
        for constraint in table.constraints
        if isinstance(constraint, sa.CheckConstraint)
    }
    expected_triggers = {
        "journal_no_update_delete",
        "journal_no_truncate",
        "journal_append_guard",  # 0017: the journal's guards, on the parent and cloned to every partition
        "journal_within_head",
        "agents_revision_guard",
        "agents_journaled",
        "jobs_guard",
        "delivery_log_guard",  # 0021: a confirmation may go with its pruned message, and only so
        "delivery_log_no_truncate",
        "jobs_prune_guard",  # 0021: retention prunes finished work only, leaving each key's tombstone
        "outbox_prune_guard",
        "jobs_pruned_key_skip",  # 0021: a pruned key stays taken
        "outbox_pruned_key_skip",
        "requests_guard",  # 0021: a request's row changes only to be pruned
        "audit_verified_chains_guard",  # 0024: a chain's broken mark stays until the owner deletes its checkpoint
        "beat_chores_guard",  # 0024: no chore stamped after the database's clock
        "agents_delete_guard",
        "agents_no_truncate",
        "deleted_agents_checked",
        "deleted_agents_with_deletion",
        "deleted_agents_no_update_delete",
        "deleted_agents_no_truncate",
        "legacy_chains_frozen",
        "legacy_chains_no_truncate",
        "archived_partitions_no_update_delete",
        "archived_partitions_no_truncate",
        "api_tokens_guard",
        "api_tokens_no_truncate",
        "journal_kpis",
        "jobs_kpis",
        "delivery_log_kpis",
        # (the journal's: its append guard checks the agent, 0029)
        *(f"{table}_agent_exists" for table in ("requests", "jobs", "outbox")),
    }
    migrations.upgrade(empty_db_url)
    first = _guards(empty_db_url)
    assert first == (expected_triggers, expected_checks)
    migrations.downgrade(empty_db_url, "base")
    assert _guards(empty_db_url) == (set(), set())
    migrations.upgrade(empty_db_url)
    assert _guards(empty_db_url) == first


def _trigger_defs(url: str) -> dict[str, str]:
    with psycopg.connect(libpq_url(url)) as conn:
        rows = conn.execute(
            "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger"
            " WHERE tgname IN ('jobs_guard', 'jobs_kpis', 'journal_agent_exists') AND NOT tgisinternal"
            " AND tgrelid IN ('jobs'::regclass, 'audit.journal'::regclass)"
        ).fetchall()
    return {name: definition for name, definition in rows}


def test_0029_fires_the_jobs_triggers_only_for_the_columns_they_read_and_its_downgrade_restores_them(
    empty_db_url: str,
) -> None:
    migrations.upgrade(empty_db_url)
    up = _trigger_defs(empty_db_url)
    assert set(up) == {"jobs_guard", "jobs_kpis"}, "the journal's agent check is its append guard's now"
    assert "BEFORE UPDATE OF key, agent_id, status, fencing_token ON public.jobs" in up["jobs_guard"]
    assert (
        "AFTER UPDATE OF status, fencing_token, error_attempts, tokens, cost, failed_tokens, failed_cost"
        in (up["jobs_kpis"])
    )
    assert "WHEN ((((new.status <> old.status)" in up["jobs_kpis"], "the WHEN clause is kept as it was"
    migrations.downgrade(empty_db_url, "0028")
    down = _trigger_defs(empty_db_url)
    assert set(down) == {"jobs_guard", "jobs_kpis", "journal_agent_exists"}
    assert "BEFORE UPDATE ON public.jobs" in down["jobs_guard"]
    assert down["jobs_kpis"].replace("AFTER UPDATE ON", "") == up["jobs_kpis"].replace(
        "AFTER UPDATE OF status, fencing_token, error_attempts, tokens, cost, failed_tokens, failed_cost ON", ""
    )
    migrations.upgrade(empty_db_url)
    assert _trigger_defs(empty_db_url) == up


def test_0021_downgrade_restores_the_append_only_delivery_log(empty_db_url: str) -> None:
    """Down from 0021 the delivery log refuses every DELETE again and its foreign key no longer cascades."""
    migrations.upgrade(empty_db_url)
    migrations.downgrade(empty_db_url, "0020")
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        rule: Any = conn.execute(
            "SELECT confdeltype FROM pg_constraint WHERE conname = 'fk_delivery_log_key_outbox'"
        ).fetchone()
        guard: Any = conn.execute(
            "SELECT tgfoid::regproc::text FROM pg_trigger WHERE tgname = 'delivery_log_no_update_delete'"
        ).fetchone()
    assert rule == ("a",) and guard == ("keel_refuse_change",)


def test_0005_downgrade_restores_the_agents_guard_it_replaced(empty_db_url: str) -> None:
    def guard() -> str:
        with psycopg.connect(libpq_url(empty_db_url)) as conn:
            row: Any = conn.execute("SELECT pg_get_functiondef('keel_agents_revision_guard'::regproc)").fetchone()
        return str(row[0])

    migrations.upgrade(empty_db_url, "0004")
    before = guard()
    migrations.upgrade(empty_db_url)
    assert "must be journaled" in guard() and "NEW.priority" in guard()
    migrations.downgrade(empty_db_url, "0004")
    assert guard() == before


def test_0014_guards_waiting_since_and_its_downgrade_restores_the_guard_it_replaced(empty_db_url: str) -> None:
    def guard() -> str:
        with psycopg.connect(libpq_url(empty_db_url)) as conn:
            row: Any = conn.execute("SELECT pg_get_functiondef('keel_agents_revision_guard'::regproc)").fetchone()
        return str(row[0])

    migrations.upgrade(empty_db_url, "0013")
    before = guard()
    migrations.upgrade(empty_db_url)
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        conn.execute("INSERT INTO agents (name) VALUES ('guarded')")
        with pytest.raises(psycopg.errors.RaiseException, match="must bump the revision"):
            conn.execute("UPDATE agents SET waiting_since = now()")  # state: only a transition changes it
        conn.rollback()
        with pytest.raises(psycopg.errors.CheckViolation, match="waiting_since_only_while_waiting"):
            conn.execute("INSERT INTO agents (name, waiting_since) VALUES ('odd', now())")
    migrations.downgrade(empty_db_url, "0013")
    assert guard() == before


def test_0018_downgrade_is_refused_once_a_month_was_archived(empty_db_url: str) -> None:
    migrations.upgrade(empty_db_url)
    with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO audit.archived_partitions (partition, to_at, events, manifests, heads, archived_by,"
            " archived_at, key_id, seal) VALUES ('journal_legacy', now(), 0, '[]', '{}', 'test', now(), 'k', 's')"
        )
    with pytest.raises(DowngradeRefused, match=r"cannot downgrade below 0018: audit\.archived_partitions records 1"):
        migrations.downgrade(empty_db_url, "0017")
    assert migrations.revision_at(empty_db_url) == migrations.head()  # nothing downgraded: one transaction


def test_0019_seals_the_audit_records_written_before_it(empty_db_url: str) -> None:
    """Rows of audit_verifications and audit_shipments from before 0019 are sealed by it with the current audit key
    (the suite's, from KEEL_AUDIT_KEYS), so the alert and the shipper go on believing them; downgrading drops the
    seals."""
    migrations.upgrade(empty_db_url, "0018")
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        conn.execute(
            "INSERT INTO audit_verifications (source, ok, agents, events, breaks, details)"
            """ VALUES ('beat', false, 2, 9, 1, '{"breaks": [{"seq": 3, "agent_id": "a"}], "legacy_events": 0}')"""
        )
        conn.execute(
            "INSERT INTO audit_shipments (destination, first_id, last_id, events, segment, manifest_sha256)"
            " VALUES ('file:///store', 1, 5, 5, 'journal/00000000000000000001-00000000000000000005.jsonl', 'ab')"
        )
    migrations.upgrade(empty_db_url)
    db = Database(empty_db_url, pool_size=1, audit_keys=TEST_KEYS)
    try:
        latest = alerts_sql.last_verification(db)
        assert latest is not None and latest.forged is None and (latest.ok, latest.breaks) == (False, 1)
        assert recorded_last_id(db, "file:///store") == 5
    finally:
        db.dispose()
    migrations.downgrade(empty_db_url, "0018")
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        assert conn.execute("SELECT count(*) FROM audit_shipments").fetchone() == (1,)
    migrations.upgrade(empty_db_url)
    migrations.check(empty_db_url)


def _due_indexes(url: str) -> dict[str, tuple[str, bool]]:
    with psycopg.connect(libpq_url(url)) as conn:
        rows: list[Any] = conn.execute(
            "SELECT c.relname, pg_get_indexdef(i.indexrelid), i.indisvalid FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'jobs'::regclass"
            " AND c.relname ~ '^ix_jobs_(pending|enqueued|leased)'"
        ).fetchall()
    return {name: (definition, valid) for name, definition, valid in rows}


def test_0026_rebuilds_the_due_indexes_without_blocking_writes(empty_db_url: str) -> None:
    """A writer holds the jobs table while the upgrade runs (a claim in flight): the upgrade waits for it, and a second
    writer meanwhile is not queued behind the upgrade — a plain CREATE or DROP INDEX would take a lock that stops it
    (and every claim and outcome after it) until the build ended, on a table of millions of finished jobs. What an
    earlier run cut short (a left-over ``…_next`` index) is built again."""
    import threading
    import time

    migrations.upgrade(empty_db_url, "0025")
    with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as conn:
        (agent,) = conn.execute(  # type: ignore[misc]
            "INSERT INTO agents (name, created_at, updated_at) VALUES ('i', now(), now()) RETURNING id"
        ).fetchone()
        for n in (1, 2):
            conn.execute(
                "INSERT INTO jobs (key, agent_id, request_id, operation, target, queue, run_at)"
                " VALUES (%s, %s, 'r', 'count', %s, 'keel.jobs', now())",
                (f"r:count:{n}", agent, str(n)),
            )
        # What interrupted runs leave: a build cut short (an invalid index), a finished build whose old index was
        # already dropped (the only due index of its case left), and an index of that name on other columns.
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("CREATE UNIQUE INDEX CONCURRENTLY ix_jobs_pending_next ON jobs (queue)")
        conn.execute("CREATE INDEX ix_jobs_leased_next ON jobs (queue, lease_until) WHERE status = 'running'")
        conn.execute("DROP INDEX ix_jobs_leased")
        conn.execute("CREATE INDEX ix_jobs_enqueued_next ON jobs (key)")
        (finished,) = conn.execute("SELECT 'ix_jobs_leased_next'::regclass::oid").fetchone()  # type: ignore[misc]
    assert _due_indexes(empty_db_url)["ix_jobs_pending_next"][1] is False, "the leftover is invalid"
    holder = psycopg.connect(libpq_url(empty_db_url))
    holder.execute("LOCK TABLE jobs IN ROW EXCLUSIVE MODE")  # what an INSERT or UPDATE holds to its commit
    errors: list[BaseException] = []

    def upgrading() -> None:
        try:
            migrations.upgrade(empty_db_url, "0026")
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    upgrade = threading.Thread(target=upgrading)
    upgrade.start()
    try:
        with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as watch:
            end = time.monotonic() + 60
            while time.monotonic() < end:
                waiting = watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query ~* 'index'"
                ).fetchone()
                if waiting is not None and waiting[0]:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("the upgrade never waited for the writer")
        with psycopg.connect(libpq_url(empty_db_url)) as writer:
            writer.execute("SET lock_timeout = '3s'")
            writer.execute("LOCK TABLE jobs IN ROW EXCLUSIVE MODE")  # raises LockNotAvailable if queued behind it
            writer.rollback()
    finally:
        holder.rollback()
        holder.close()
        upgrade.join(120)
    assert not errors, errors
    indexes = _due_indexes(empty_db_url)
    assert set(indexes) == {"ix_jobs_pending", "ix_jobs_enqueued", "ix_jobs_leased"}, "no left-over index"
    assert all(valid for _, valid in indexes.values())
    assert "(queue, priority, run_at)" in indexes["ix_jobs_pending"][0]
    assert "(queue, lease_until)" in indexes["ix_jobs_leased"][0]
    assert "(queue, enqueued_at)" in indexes["ix_jobs_enqueued"][0]
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        (kept,) = conn.execute("SELECT 'ix_jobs_leased'::regclass::oid").fetchone()  # type: ignore[misc]
    assert kept == finished, "a finished build is put in place, not dropped and built again"
    migrations.upgrade(empty_db_url)
    migrations.check(empty_db_url)
    migrations.downgrade(empty_db_url, "0025")
    assert "(priority, run_at)" in _due_indexes(empty_db_url)["ix_jobs_pending"][0]
    assert "(enqueued_at)" in _due_indexes(empty_db_url)["ix_jobs_enqueued"][0]


def test_0027_refuses_a_job_on_a_queue_the_dispatcher_does_not_read(empty_db_url: str) -> None:
    """A job written with another queue would never be published nor recovered: the table refuses it."""
    migrations.upgrade(empty_db_url)
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        (agent,) = conn.execute(  # type: ignore[misc]
            "INSERT INTO agents (name, created_at, updated_at) VALUES ('q', now(), now()) RETURNING id"
        ).fetchone()
        insert = (
            "INSERT INTO jobs (key, agent_id, request_id, operation, target, queue, run_at)"
            " VALUES (%s, %s, 'r', 'count', '1', %s, now())"
        )
        from models.tables import JOB_QUEUES

        for n, queue in enumerate(JOB_QUEUES):  # the model's queues and the migration's are the same
            conn.execute(insert, (f"r:count:q{n}", agent, queue))
        with pytest.raises(psycopg.errors.CheckViolation, match="ck_jobs_queue"):
            conn.execute(insert, ("r:count:2", agent, "celery"))
        conn.rollback()
        (validated,) = conn.execute(  # type: ignore[misc]
            "SELECT convalidated FROM pg_constraint WHERE conname = 'ck_jobs_queue'"
        ).fetchone()
        assert validated, "validated: the rows from before it hold too"


def test_0027_names_the_jobs_on_other_queues_and_changes_nothing(empty_db_url: str) -> None:
    """A job already on a queue the dispatcher does not read: VALIDATE would fail on every run (and the constraint,
    left NOT VALID, refuse every update of it). The upgrade names it and stops; once it is moved, it goes through."""
    from models.migrations import UpgradeRefused

    migrations.upgrade(empty_db_url, "0026")
    with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as conn:
        (agent,) = conn.execute(  # type: ignore[misc]
            "INSERT INTO agents (name, created_at, updated_at) VALUES ('q', now(), now()) RETURNING id"
        ).fetchone()
        conn.execute(
            "INSERT INTO jobs (key, agent_id, request_id, operation, target, queue, run_at)"
            " VALUES ('r:count:1', %s, 'r', 'count', '1', 'celery', now())",
            (agent,),
        )
        with pytest.raises(UpgradeRefused, match=r"'r:count:1' on 'celery'.*UPDATE jobs SET queue = 'keel.jobs'"):
            migrations.upgrade(empty_db_url)
        assert migrations.revision_at(empty_db_url) == "0026"
        assert conn.execute("SELECT 1 FROM pg_constraint WHERE conname = 'ck_jobs_queue'").fetchone() is None
        conn.execute("UPDATE jobs SET queue = 'keel.jobs' WHERE queue = 'celery'")
    migrations.upgrade(empty_db_url)
    assert migrations.revision_at(empty_db_url) == migrations.head()
