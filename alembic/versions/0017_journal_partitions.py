"""The journal partitioned by month (docs/audit-retention.md): the table as it is becomes the first partition,
``audit.journal_legacy``, with no row copied and nothing re-hashed; a parent partitioned by range of ``at`` takes the
name ``audit.journal``, and months ahead get partitions ``audit.journal_YYYY_MM`` of a fixed shape from
``audit.keel_ensure_partitions(months_ahead)``.

Online, in two parts. Part 1 runs outside a transaction, beside traffic: the proof that every row is older than the
legacy partition's upper bound (a CHECK added NOT VALID, then validated under a lock that lets inserts through) and
the new primary key's index (built concurrently). Part 2 is the swap, catalog changes only, under a short ACCESS
EXCLUSIVE lock taken with a lock timeout and retried, so a long reader makes the migration wait rather than every
append queue behind it.

A primary key on a partitioned table must include the partition key: ``pk_journal`` becomes ``(id, at)`` and
``(agent_id, seq)`` is unique per partition only. The guards on the parent (cloned to every partition) keep both
unique across months, whoever inserts: an event's id is drawn by the guard itself from ``audit.journal_id_seq``
(the column has no default: a row that brings an id of its own, ``OVERRIDING SYSTEM VALUE`` or not, is refused), its
time is the database's clock during its own transaction, its seq is its chain's head + 1 under the agent's lock, and
at commit it is covered by its chain's head.

Downgrading is refused once a partition was archived (``audit.archived_partitions`` has rows: those events are gone
from the database). Otherwise the reverse swap: rows of the monthly partitions are copied back into the legacy table,
which is detached and becomes ``audit.journal`` again with its primary key, identity and triggers.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-01
"""

from __future__ import annotations

import time
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from models.migrations import DowngradeRefused

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

#: How long the swap waits for its lock, how often it tries.
LOCK_TIMEOUT = "2s"
ATTEMPTS = 30

# The id is drawn here, for this row, by the guard itself (SECURITY DEFINER, owned by the owner: the application has
# no privilege on the sequence); a row that brings an id of its own is refused. The guard runs for everyone, the owner
# and superusers included, while triggers fire.
_APPEND_GUARD = """
CREATE FUNCTION audit.keel_journal_append_guard() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    head bigint;
BEGIN
    -- 1. The id is the sequence's, drawn now for this very row: an id brought along (with OVERRIDING SYSTEM VALUE,
    --    or any other way) could repeat one of another month, where the primary key (id, at) cannot see it.
    IF NEW.id IS NOT NULL THEN
        RAISE EXCEPTION 'audit.journal: an event''s id comes from the journal''s sequence, not from its writer (id % refused)',
            NEW.id USING ERRCODE = 'insufficient_privilege';
    END IF;
    NEW.id := nextval('audit.journal_id_seq'::regclass);
    -- 2. The time is the database's clock during this transaction (Keel reads clock_timestamp() under the agent's
    --    lock, in the transaction that appends): nobody writes into a past month, so a month once over is closed.
    IF NEW.at < transaction_timestamp() OR NEW.at > clock_timestamp() THEN
        RAISE EXCEPTION 'audit.journal: an event''s time is the database clock during its own transaction (% refused)',
            NEW.at USING ERRCODE = 'check_violation';
    END IF;
    -- 3. The event is the next of its chain: the head, read under the agent's row lock (Keel holds it already: no
    --    extra wait), is one behind. A committed event always has seq <= its head (4.), and the head never moves
    --    back, so a seq once committed is never accepted again, in any month.
    SELECT journal_seq INTO head FROM public.agents WHERE id = NEW.agent_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'journal: agent % does not exist (or was deleted)', NEW.agent_id
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    IF NEW.seq <> head + 1 THEN
        RAISE EXCEPTION 'audit.journal: event % of agent % is not the next of its chain (head %)',
            NEW.seq, NEW.agent_id, head USING ERRCODE = 'unique_violation';
    END IF;
    -- Twice the same seq in one transaction, before the head moved: only this transaction's months can hold it.
    -- Within one month (UTC) they are one partition, whose unique (agent_id, seq) index refuses the second; only a
    -- transaction that began in an earlier month needs the look across partitions.
    IF date_trunc('month', transaction_timestamp(), 'UTC') <> date_trunc('month', NEW.at, 'UTC')
       AND EXISTS (SELECT 1 FROM audit.journal j WHERE j.agent_id = NEW.agent_id AND j.seq = NEW.seq
                   AND j.at >= transaction_timestamp()) THEN
        RAISE EXCEPTION 'audit.journal: event % of agent % exists already', NEW.seq, NEW.agent_id
            USING ERRCODE = 'unique_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER journal_append_guard BEFORE INSERT ON audit.journal
    FOR EACH ROW EXECUTE FUNCTION audit.keel_journal_append_guard();
"""

# 4. At commit every appended event is covered by its chain's head (the agent row's or, once deleted, its tombstone's):
# an event left past the head would be accepted a second time, in another month, by the next append.
_WITHIN_HEAD = """
CREATE FUNCTION audit.keel_journal_within_head() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    head bigint;
BEGIN
    SELECT journal_seq INTO head FROM public.agents WHERE id = NEW.agent_id;
    IF NOT FOUND THEN
        SELECT journal_seq INTO head FROM audit.deleted_agents WHERE agent_id = NEW.agent_id;
    END IF;
    IF head IS NULL OR NEW.seq > head THEN
        RAISE EXCEPTION 'audit.journal: event % of agent % is past the head of its chain (head %) at commit',
            NEW.seq, NEW.agent_id, head USING ERRCODE = 'unique_violation';
    END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER journal_within_head AFTER INSERT ON audit.journal
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION audit.keel_journal_within_head();
"""

# Partitions are the owner's, of one shape, for the current month and months ahead only, never a past one. Created
# beside the journal and attached (SHARE UPDATE EXCLUSIVE on the parent: appends and reads go on), with the parent's
# indexes and row triggers that the attach adds, its own unique (agent_id, seq) index and its own no-truncate
# trigger (statement triggers are not cloned).
_ENSURE_PARTITIONS = """
CREATE FUNCTION audit.keel_ensure_partitions(months_ahead integer) RETURNS SETOF text LANGUAGE plpgsql
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET TimeZone = 'UTC' SET lock_timeout = '10s' AS $$
DECLARE
    this_month timestamptz := date_trunc('month', now());
    covered timestamptz;
    first timestamptz;
    next timestamptz;
    name text;
BEGIN
    IF months_ahead IS NULL OR months_ahead < 1 OR months_ahead > 12 THEN
        RAISE EXCEPTION 'keel_ensure_partitions: months_ahead must be 1 to 12, not %', months_ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('audit.keel_ensure_partitions'));  -- two callers: one creates
    SELECT max((regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([^'']+)''\\)'))[1]::timestamptz)
        INTO covered FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'audit.journal'::regclass;
    first := greatest(coalesce(covered, this_month), this_month);
    WHILE first < this_month + make_interval(months => months_ahead + 1) LOOP
        next := first + interval '1 month';
        name := 'journal_' || to_char(first, 'YYYY_MM');
        EXECUTE format('CREATE TABLE audit.%I (LIKE audit.journal INCLUDING DEFAULTS INCLUDING CONSTRAINTS'
                       ' INCLUDING STORAGE INCLUDING COMPRESSION)', name);
        EXECUTE format('ALTER TABLE audit.%I ADD CONSTRAINT %I CHECK (at >= %L AND at < %L)',
                       name, name || '_bound', first, next);
        EXECUTE format('CREATE UNIQUE INDEX %I ON audit.%I (agent_id, seq)', name || '_agent_id_seq', name);
        EXECUTE format('CREATE TRIGGER journal_no_truncate BEFORE TRUNCATE ON audit.%I'
                       ' FOR EACH STATEMENT EXECUTE FUNCTION audit.refuse_change()', name);
        EXECUTE format('ALTER TABLE audit.journal ATTACH PARTITION audit.%I FOR VALUES FROM (%L) TO (%L)',
                       name, first, next);
        EXECUTE format('ALTER TABLE audit.%I DROP CONSTRAINT %I', name, name || '_bound');
        RETURN NEXT name;
        first := next;
    END LOOP;
END $$;
REVOKE ALL ON FUNCTION audit.keel_ensure_partitions(integer) FROM PUBLIC;
"""

# 0006's check that a row's agent exists, naming the table a partition belongs to ("journal", not "journal_legacy")
# when it refuses. _AGENT_EXISTS_0006 is the function as 0006 wrote it, restored by the downgrade.
_AGENT_EXISTS = """
CREATE OR REPLACE FUNCTION keel_agent_exists() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM agents WHERE id = NEW.agent_id FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: agent % does not exist (or was deleted)',
            (SELECT c.relname FROM pg_class c WHERE c.oid = coalesce(pg_partition_root(TG_RELID), TG_RELID)),
            NEW.agent_id USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NEW;
END;
$$;
"""
_AGENT_EXISTS_0006 = """
CREATE OR REPLACE FUNCTION keel_agent_exists() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM agents WHERE id = NEW.agent_id FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: agent % does not exist (or was deleted)', TG_TABLE_NAME, NEW.agent_id
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NEW;
END;
$$;
"""



def _upper_bound() -> datetime:
    """The legacy partition's upper bound: the first of next month (UTC), or of the month after when this month has
    less than an hour left, so no row appended while part 1 runs can fall past it."""
    bound = op.get_bind().execute(
        sa.text(
            "SELECT (date_trunc('month', (clock_timestamp() + interval '1 hour') AT TIME ZONE 'UTC')"
            " + interval '1 month') AT TIME ZONE 'UTC'"
        )
    ).scalar_one()
    assert isinstance(bound, datetime)
    return bound


def _swap(bind: sa.Connection, bound: str) -> None:
    last = bind.execute(
        sa.text("SELECT last_value, is_called FROM audit.journal_id_seq")
    ).one()  # read while nobody can insert
    for statement in (
        "ALTER TABLE audit.journal RENAME TO journal_legacy",
        "ALTER TABLE audit.journal_legacy DROP CONSTRAINT pk_journal,"
        " ADD CONSTRAINT journal_legacy_pkey PRIMARY KEY USING INDEX journal_legacy_id_at",
        "ALTER TABLE audit.journal_legacy ALTER COLUMN id DROP IDENTITY",  # the parent's guard numbers rows now
        # The parent's row triggers (cloned on attach) replace these; journal_no_truncate stays: not cloned.
        "DROP TRIGGER journal_no_update_delete ON audit.journal_legacy",
        "DROP TRIGGER journal_agent_exists ON audit.journal_legacy",
        "DROP TRIGGER journal_kpis ON audit.journal_legacy",
        "ALTER INDEX audit.ix_journal_request_id RENAME TO journal_legacy_request_id_idx",  # names are per schema
        # Columns and CHECKs as the table has them; its bound (copied by LIKE) would refuse every future event.
        "CREATE TABLE audit.journal (LIKE audit.journal_legacy INCLUDING DEFAULTS INCLUDING CONSTRAINTS"
        " INCLUDING STORAGE INCLUDING COMPRESSION) PARTITION BY RANGE (at)",
        "ALTER TABLE audit.journal DROP CONSTRAINT journal_legacy_bound",
        "ALTER TABLE audit.journal ADD CONSTRAINT pk_journal PRIMARY KEY (id, at)",
        "CREATE SEQUENCE audit.journal_id_seq AS bigint OWNED BY audit.journal.id",
        "CREATE INDEX ix_journal_request_id ON audit.journal (request_id)",
        "CREATE TRIGGER journal_no_update_delete BEFORE UPDATE OR DELETE ON audit.journal"
        " FOR EACH ROW EXECUTE FUNCTION audit.refuse_change()",
        "CREATE TRIGGER journal_no_truncate BEFORE TRUNCATE ON audit.journal"
        " FOR EACH STATEMENT EXECUTE FUNCTION audit.refuse_change()",
        "CREATE TRIGGER journal_agent_exists BEFORE INSERT OR UPDATE OF agent_id ON audit.journal"
        " FOR EACH ROW EXECUTE FUNCTION keel_agent_exists()",
        "CREATE TRIGGER journal_kpis AFTER INSERT ON audit.journal FOR EACH ROW"
        " WHEN (NEW.kind IN ('transition', 'suppressed')) EXECUTE FUNCTION keel_kpi_journal()",
        _AGENT_EXISTS,
        _APPEND_GUARD,
        _WITHIN_HEAD,
        # No scan: the validated bound proves the partition constraint.
        f"ALTER TABLE audit.journal ATTACH PARTITION audit.journal_legacy FOR VALUES FROM (MINVALUE) TO ('{bound}')",
        "ALTER TABLE audit.journal_legacy DROP CONSTRAINT journal_legacy_bound",
        _ENSURE_PARTITIONS,
    ):
        bind.execute(sa.text(statement))
    bind.execute(
        sa.text("SELECT setval('audit.journal_id_seq', :last, :called)"),
        {"last": last.last_value, "called": last.is_called},
    )
    bind.execute(sa.text("SELECT audit.keel_ensure_partitions(3)"))  # the bound's month and the two after it


def upgrade() -> None:
    bound = _upper_bound().isoformat()
    with op.get_context().autocommit_block():  # part 1: beside traffic, no strong lock
        # What an earlier run cut short left behind (an interrupted concurrent build leaves an invalid index).
        op.execute("ALTER TABLE audit.journal DROP CONSTRAINT IF EXISTS journal_legacy_bound")
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS audit.journal_legacy_id_at")
        op.execute(f"ALTER TABLE audit.journal ADD CONSTRAINT journal_legacy_bound CHECK (at < '{bound}') NOT VALID")
        op.execute("ALTER TABLE audit.journal VALIDATE CONSTRAINT journal_legacy_bound")
        op.execute("CREATE UNIQUE INDEX CONCURRENTLY journal_legacy_id_at ON audit.journal (id, at)")
    bind = op.get_bind()
    bind.execute(sa.text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    for attempt in range(1, ATTEMPTS + 1):  # part 2: the swap, catalog changes only
        try:
            with bind.begin_nested():
                bind.execute(sa.text("LOCK TABLE audit.journal IN ACCESS EXCLUSIVE MODE"))
                _swap(bind, bound)
            break
        except sa.exc.OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != "55P03" or attempt == ATTEMPTS:  # lock_not_available
                raise
            time.sleep(min(attempt, 5))
    bind.execute(sa.text("SET LOCAL lock_timeout = 0"))


def downgrade() -> None:
    bind = op.get_bind()
    # The archive's own table (its own migration) may not exist yet: then nothing was archived.
    archived = 0
    if bind.execute(sa.text("SELECT to_regclass('audit.archived_partitions')")).scalar() is not None:
        archived = bind.execute(sa.text("SELECT count(*) FROM audit.archived_partitions")).scalar_one()
    if archived:
        raise DowngradeRefused(
            f"cannot downgrade below 0017: {archived} journal partition(s) were archived (audit.archived_partitions):"
            " their events left the database and cannot be put back into one table; stay on 0017 or later"
        )
    bind.execute(sa.text("LOCK TABLE audit.journal IN ACCESS EXCLUSIVE MODE"))
    last = bind.execute(sa.text("SELECT last_value, is_called FROM audit.journal_id_seq")).one()
    for statement in (
        "ALTER TABLE audit.journal DETACH PARTITION audit.journal_legacy",  # its cloned triggers go with it
        # Rows of the monthly partitions back into the one table, ids as they were (the table has no identity now).
        "INSERT INTO audit.journal_legacy SELECT * FROM audit.journal ORDER BY id",
        "DROP TABLE audit.journal",  # the parent, its monthly partitions and its sequence
        "DROP FUNCTION audit.keel_ensure_partitions(integer)",
        "DROP FUNCTION audit.keel_journal_append_guard()",
        "DROP FUNCTION audit.keel_journal_within_head()",
        _AGENT_EXISTS_0006,
        "ALTER TABLE audit.journal_legacy RENAME TO journal",
        "ALTER TABLE audit.journal DROP CONSTRAINT journal_legacy_pkey, ADD CONSTRAINT pk_journal PRIMARY KEY (id)",
        "ALTER TABLE audit.journal ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY"
        " (SEQUENCE NAME audit.journal_id_seq)",
        "ALTER INDEX audit.journal_legacy_request_id_idx RENAME TO ix_journal_request_id",
        "CREATE TRIGGER journal_no_update_delete BEFORE UPDATE OR DELETE ON audit.journal"
        " FOR EACH ROW EXECUTE FUNCTION audit.refuse_change()",
        "CREATE TRIGGER journal_agent_exists BEFORE INSERT OR UPDATE OF agent_id ON audit.journal"
        " FOR EACH ROW EXECUTE FUNCTION keel_agent_exists()",
        "CREATE TRIGGER journal_kpis AFTER INSERT ON audit.journal FOR EACH ROW"
        " WHEN (NEW.kind IN ('transition', 'suppressed')) EXECUTE FUNCTION keel_kpi_journal()",
    ):
        bind.execute(sa.text(statement))
    bind.execute(
        sa.text("SELECT setval('audit.journal_id_seq', :last, :called)"),
        {"last": last.last_value, "called": last.is_called},
    )
