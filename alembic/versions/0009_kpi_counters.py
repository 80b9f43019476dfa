"""KPI counters: triggers that insert into ``kpi_deltas`` in the very transactions that move each KPI.

- ``audit.journal`` INSERT (transition and suppressed events only: a ``WHEN`` clause leaves the others alone):
  suppressed duplicates by kind (a repeated submit, a duplicate job delivery, and the job and message keys a
  transition found already there: ``details.jobs_suppressed`` / ``details.messages_suppressed``); fenced-off
  outcomes (decision ``fenced_off``, and the spend such a charge carries); requests finished done/failed with
  their duration from ``requests.submitted_at``; the database-side latency of each transition
  (``clock_timestamp() - now()``: transaction start to its journal event) as a histogram; budget stops, hard
  deadline stops and soft deadline demotions.
- ``jobs`` UPDATE, only when a counted column moves (``WHEN``: claims, enqueues and lease renewals cost nothing):
  jobs finished by operation and status, attempt failures by error class (from ``error_attempts``), first
  failures (counted at the failure), jobs that failed at least once and then finished (succeeded, failed or dead;
  counted when they finish, a cancelled one left out) and of those the recovered ones (succeeded): the recovery
  rate's two terms, counted at the same moment; spent and retry-caused tokens and cost (deltas of
  ``tokens``/``cost``/``failed_*``), lease takeovers (a running job taken over after its lease expired).
- ``delivery_log`` INSERT (per statement): confirmations per channel, and confirmations of a key that already had
  one (side-effect duplicates: must stay 0).

A counter row is ``(name, label, value)``; a label is ``k=v`` pairs joined by ``,`` (every labelled value is an
identifier: see ``models/kpi_sql.py``). A histogram is stored like Prometheus's: ``NAME_bucket`` rows whose label
ends in ``le=UPPER`` (counts per bucket, not cumulative), ``NAME_sum`` and ``NAME_count``. The bucket bounds here
are ``TRANSITION_SECONDS_BUCKETS`` and ``REQUEST_SECONDS_BUCKETS`` of ``models/kpi_sql.py`` (a test holds them
equal).

``ix_outbox_dead``: the dead letters per channel, read on every scrape, without reading the outbox.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

TRANSITION_BOUNDS = "{0.001,0.0025,0.005,0.01,0.025,0.05,0.1,0.25,0.5,1,2.5,5,10}"
REQUEST_BOUNDS = "{0.5,1,2.5,5,10,30,60,120,300,600,1800,3600,7200,21600,86400}"

BUCKET = """
CREATE FUNCTION keel_kpi_le(v double precision, bounds double precision[]) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    b double precision;
BEGIN
    FOREACH b IN ARRAY bounds LOOP
        IF v <= b THEN
            RETURN b::text;
        END IF;
    END LOOP;
    RETURN '+Inf';
END;
$$;
"""

# Never raises on what a journal event may hold: a trigger that failed would fail the transition it counts.
JOURNAL = f"""
CREATE FUNCTION keel_kpi_journal() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    elapsed double precision := extract(epoch FROM clock_timestamp() - now());
    took double precision;
    outcome text;
    found json;
BEGIN
    IF NEW.kind = 'suppressed' THEN
        IF NEW.decision = 'fenced_off' THEN
            INSERT INTO kpi_deltas (name, value) VALUES ('fenced_outcomes', 1);
        ELSE
            INSERT INTO kpi_deltas (name, label, value) VALUES ('suppressed_duplicates',
                'kind=' || CASE NEW.event WHEN 'run_job' THEN 'job_delivery' ELSE NEW.event END, 1);
        END IF;
        RETURN NULL;
    END IF;
    INSERT INTO kpi_deltas (name, label, value) VALUES
        ('phase_transition_seconds_bucket',
         'event=' || NEW.event || ',le=' || keel_kpi_le(elapsed, '{TRANSITION_BOUNDS}'), 1),
        ('phase_transition_seconds_sum', 'event=' || NEW.event, elapsed),
        ('phase_transition_seconds_count', 'event=' || NEW.event, 1);
    IF NEW.to_phase IN ('done', 'failed') AND NEW.from_phase IS DISTINCT FROM NEW.to_phase THEN
        outcome := 'outcome=' || NEW.to_phase;
        INSERT INTO kpi_deltas (name, label, value) VALUES ('requests_finished', outcome, 1);
        took := extract(epoch FROM NEW.at - (SELECT submitted_at FROM requests WHERE request_id = NEW.request_id));
        IF took IS NOT NULL THEN
            INSERT INTO kpi_deltas (name, label, value) VALUES
                ('request_duration_seconds_bucket', 'le=' || keel_kpi_le(took, '{REQUEST_BOUNDS}'), 1),
                ('request_duration_seconds_sum', '', took),
                ('request_duration_seconds_count', '', 1);
        END IF;
        IF NEW.decision = 'budget_exhausted' THEN
            INSERT INTO kpi_deltas (name, value) VALUES ('budget_stops', 1);
        ELSIF NEW.decision = 'hard_deadline_passed' THEN
            INSERT INTO kpi_deltas (name, label, value) VALUES ('deadline_stops', 'kind=hard', 1);
        END IF;
    ELSIF NEW.decision = 'soft_deadline_passed' THEN
        INSERT INTO kpi_deltas (name, label, value) VALUES ('deadline_stops', 'kind=soft', 1);
    ELSIF NEW.decision = 'fenced_off' THEN
        -- Spend of an attempt whose outcome was void, charged to the agent but recorded on no job: wasted on a retry.
        INSERT INTO kpi_deltas (name, value) VALUES ('fenced_outcomes', 1);
        found := NEW.details -> 'spend';
        IF json_typeof(found) = 'object' AND json_typeof(found -> 'tokens') = 'number'
           AND (found ->> 'cost') ~ '^[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?$' THEN
            INSERT INTO kpi_deltas (name, value) VALUES
                ('spent_tokens', (found ->> 'tokens')::numeric),
                ('spent_cost', (found ->> 'cost')::numeric),
                ('retry_tokens', (found ->> 'tokens')::numeric),
                ('retry_cost', (found ->> 'cost')::numeric);
        END IF;
    END IF;
    -- Keys a transition found already there (an ON CONFLICT DO NOTHING): most events have none, and the text test
    -- spares them parsing their details.
    IF strpos(NEW.details::text, '_suppressed"') > 0 THEN
        found := NEW.details -> 'jobs_suppressed';
        IF json_typeof(found) = 'array' AND json_array_length(found) > 0 THEN
            INSERT INTO kpi_deltas (name, label, value) VALUES ('suppressed_duplicates', 'kind=job_insert',
                json_array_length(found));
        END IF;
        found := NEW.details -> 'messages_suppressed';
        IF json_typeof(found) = 'array' AND json_array_length(found) > 0 THEN
            INSERT INTO kpi_deltas (name, label, value) VALUES ('suppressed_duplicates', 'kind=message_insert',
                json_array_length(found));
        END IF;
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER journal_kpis AFTER INSERT ON audit.journal FOR EACH ROW
    WHEN (NEW.kind IN ('transition', 'suppressed')) EXECUTE FUNCTION keel_kpi_journal();
"""

JOBS = """
CREATE FUNCTION keel_kpi_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status <> OLD.status AND NEW.status IN ('succeeded', 'failed', 'cancelled', 'dead') THEN
        INSERT INTO kpi_deltas (name, label, value)
            VALUES ('jobs_finished', 'operation=' || NEW.operation || ',status=' || NEW.status, 1);
        -- Recovery is judged when a job that failed at least once is done retrying: succeeded (recovered), failed
        -- or dead. A job cancelled meanwhile (a hard deadline, a budget stop, a cancel) had its retries cut short
        -- from outside: it says nothing about whether retrying helps, so it is left out of both.
        IF NEW.error_attempts <> '{}'::jsonb AND NEW.status <> 'cancelled' THEN
            INSERT INTO kpi_deltas (name, value) VALUES ('jobs_finished_after_failure', 1);
            IF NEW.status = 'succeeded' THEN
                INSERT INTO kpi_deltas (name, value) VALUES ('jobs_recovered', 1);
            END IF;
        END IF;
    END IF;
    IF OLD.status = 'running' AND (NEW.status = 'enqueued'
                                   OR (NEW.status = 'running' AND NEW.fencing_token <> OLD.fencing_token)) THEN
        INSERT INTO kpi_deltas (name, value) VALUES ('lease_takeovers', 1);
    END IF;
    IF NEW.error_attempts IS DISTINCT FROM OLD.error_attempts THEN
        INSERT INTO kpi_deltas (name, label, value)
        SELECT 'job_attempt_failures', 'error_class=' || n.key, n.more
        FROM (SELECT e.key, (e.value)::text::numeric
                            - CASE WHEN jsonb_typeof(OLD.error_attempts -> e.key) = 'number'
                                   THEN (OLD.error_attempts ->> e.key)::numeric ELSE 0 END AS more
              FROM jsonb_each(NEW.error_attempts) e WHERE jsonb_typeof(e.value) = 'number') n
        WHERE n.more > 0;
        IF OLD.error_attempts = '{}'::jsonb AND NEW.error_attempts <> '{}'::jsonb THEN
            INSERT INTO kpi_deltas (name, value) VALUES ('jobs_first_failures', 1);
        END IF;
    END IF;
    IF NEW.tokens + NEW.failed_tokens <> OLD.tokens + OLD.failed_tokens THEN
        INSERT INTO kpi_deltas (name, value)
            VALUES ('spent_tokens', NEW.tokens + NEW.failed_tokens - OLD.tokens - OLD.failed_tokens);
    END IF;
    IF NEW.cost + NEW.failed_cost <> OLD.cost + OLD.failed_cost THEN
        INSERT INTO kpi_deltas (name, value) VALUES ('spent_cost', NEW.cost + NEW.failed_cost - OLD.cost - OLD.failed_cost);
    END IF;
    IF NEW.failed_tokens <> OLD.failed_tokens THEN
        INSERT INTO kpi_deltas (name, value) VALUES ('retry_tokens', NEW.failed_tokens - OLD.failed_tokens);
    END IF;
    IF NEW.failed_cost <> OLD.failed_cost THEN
        INSERT INTO kpi_deltas (name, value) VALUES ('retry_cost', NEW.failed_cost - OLD.failed_cost);
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER jobs_kpis AFTER UPDATE ON jobs FOR EACH ROW
    WHEN ((NEW.status <> OLD.status AND NEW.status IN ('succeeded', 'failed', 'cancelled', 'dead'))
          OR (OLD.status = 'running'
              AND (NEW.status = 'enqueued' OR (NEW.status = 'running' AND NEW.fencing_token <> OLD.fencing_token)))
          OR NEW.error_attempts IS DISTINCT FROM OLD.error_attempts
          OR NEW.tokens <> OLD.tokens OR NEW.cost <> OLD.cost
          OR NEW.failed_tokens <> OLD.failed_tokens OR NEW.failed_cost <> OLD.failed_cost)
    EXECUTE FUNCTION keel_kpi_jobs();
"""

DELIVERIES = """
CREATE FUNCTION keel_kpi_deliveries() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO kpi_deltas (name, label, value)
    SELECT 'side_effect_confirmations', 'channel=' || o.channel, count(*)
        FROM confirmed n JOIN outbox o ON o.key = n.key GROUP BY o.channel
    UNION ALL
    SELECT 'side_effect_duplicates', 'channel=' || o.channel, count(*)
        FROM confirmed n JOIN outbox o ON o.key = n.key
        WHERE EXISTS (SELECT 1 FROM delivery_log d WHERE d.key = n.key AND d.id < n.id) GROUP BY o.channel;
    RETURN NULL;
END;
$$;
CREATE TRIGGER delivery_log_kpis AFTER INSERT ON delivery_log REFERENCING NEW TABLE AS confirmed
    FOR EACH STATEMENT EXECUTE FUNCTION keel_kpi_deliveries();
"""


def upgrade() -> None:
    op.execute(BUCKET)
    op.execute(JOURNAL)
    op.execute(JOBS)
    op.execute(DELIVERIES)
    op.create_index("ix_outbox_dead", "outbox", ["channel"], postgresql_where=sa.text("status = 'dead'"))


def downgrade() -> None:
    op.drop_index("ix_outbox_dead", table_name="outbox", postgresql_where=sa.text("status = 'dead'"))
    op.execute("DROP TRIGGER delivery_log_kpis ON delivery_log")
    op.execute("DROP FUNCTION keel_kpi_deliveries()")
    op.execute("DROP TRIGGER jobs_kpis ON jobs")
    op.execute("DROP FUNCTION keel_kpi_jobs()")
    op.execute("DROP TRIGGER journal_kpis ON audit.journal")
    op.execute("DROP FUNCTION keel_kpi_journal()")
    op.execute("DROP FUNCTION keel_kpi_le(double precision, double precision[])")
