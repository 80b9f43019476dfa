"""The schema, as SQLAlchemy Core tables. Alembic migrations must match it (``alembic check``)."""

from __future__ import annotations

import re

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Numeric,
    Sequence,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from models.schemas import MAX_NAME_CHARS, NAME_PATTERN

AUDIT_SCHEMA = "audit"

# Kept literally here because models/ may not import agents/; a unit test holds it equal to agents.core.phases.Phase.
PHASES: tuple[str, ...] = ("idle", "planning", "executing", "waiting_approval", "done", "failed")
JOURNAL_KINDS: tuple[str, ...] = ("created", "transition", "rejected", "suppressed", "operator")
JOB_STATUSES: tuple[str, ...] = ("pending", "enqueued", "running", "succeeded", "failed", "cancelled", "dead")
#: Job statuses from which nothing moves on.
JOB_FINAL: tuple[str, ...] = ("succeeded", "failed", "cancelled", "dead")
AGENT_PRIORITIES: tuple[str, ...] = ("normal", "low")
#: The job queues (agents/core/queues.py picks one per job): the normal one, and the low one for the jobs of agents
#: past their soft deadline and jobs asked with priority < 5. The dispatcher reads these only: a job on any other
#: queue would never be published, so the table refuses it.
JOBS_QUEUE = "keel.jobs"
LOW_QUEUE = "keel.jobs.low"
JOB_QUEUES: tuple[str, ...] = (JOBS_QUEUE, LOW_QUEUE)
OUTBOX_STATUSES: tuple[str, ...] = ("pending", "sending", "sent", "dead")
CHANNELS: tuple[str, ...] = ("slack", "github")
#: The request ids of Keel's own outbox messages (alerts, the daily KPI report), which belong to no agent.
SYSTEM_REQUEST_IDS: tuple[str, ...] = ("alert", "kpi")
#: Kept literally here too; a unit test holds it equal to agents.ingress.tokens.Scope.
TOKEN_SCOPES: tuple[str, ...] = ("producer", "approver", "operator", "auditor")

#: sha256 of nothing yet: the ``prev_hash`` of an agent's first journal event.
GENESIS_HASH = "0" * 64

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


Money = Numeric(18, 6)

#: Phases of an agent with a request in flight (agents/core/phases.py ACTIVE): the ones whose deadlines bite.
ACTIVE_PHASES: tuple[str, ...] = ("planning", "executing", "waiting_approval")
_ACTIVE_PHASES = _in("phase", ACTIVE_PHASES)

agents = Table(
    "agents",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    Column("name", Text, nullable=False, unique=True),
    Column("phase", Text, nullable=False, server_default="idle"),
    Column("request_id", Text),
    # The first segment of the keys of the request in flight (agents.core.keys.request_key; migration 0028).
    Column("request_key", Text),
    Column("revision", BigInteger, nullable=False, server_default="0"),
    Column("soft_deadline", DateTime(timezone=True)),
    Column("hard_deadline", DateTime(timezone=True)),
    # NULL budget = unlimited.
    Column("budget_tokens", BigInteger),
    Column("budget_cost", Money),
    Column("spent_tokens", BigInteger, nullable=False, server_default="0"),
    Column("spent_cost", Money, nullable=False, server_default="0"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # The agent's journal chain: number and hash of its latest event.
    Column("journal_seq", BigInteger, nullable=False, server_default="0"),
    Column("journal_head", Text, nullable=False, server_default=GENESIS_HASH),
    # "low" once the soft deadline has passed: the agent's jobs go to the low-priority queue.
    Column("priority", Text, nullable=False, server_default="normal"),
    # Set while the agent is archived: hidden from `keel agent list`, refusing new requests; row and journal kept.
    Column("archived_at", DateTime(timezone=True)),
    # While waiting_approval: when the wait began (the transition into it, which is when its gate finished); moves
    # within the wait (an escalation, a step of the round finishing) leave it. NULL otherwise, and for a wait that
    # began before migration 0014 (the console then orders it by updated_at).
    Column("waiting_since", DateTime(timezone=True)),
    CheckConstraint(_in("phase", PHASES), name="phase"),
    CheckConstraint(_in("priority", AGENT_PRIORITIES), name="priority"),
    CheckConstraint("revision >= 0", name="revision_non_negative"),
    CheckConstraint("char_length(name) BETWEEN 1 AND 200", name="name_length"),
    CheckConstraint("budget_tokens IS NULL OR budget_tokens >= 0", name="budget_tokens_non_negative"),
    CheckConstraint("budget_cost IS NULL OR budget_cost >= 0", name="budget_cost_non_negative"),
    CheckConstraint("spent_tokens >= 0", name="spent_tokens_non_negative"),
    CheckConstraint("spent_cost >= 0", name="spent_cost_non_negative"),
    CheckConstraint(
        "soft_deadline IS NULL OR hard_deadline IS NULL OR soft_deadline <= hard_deadline",
        name="soft_before_hard",
    ),
    CheckConstraint("waiting_since IS NULL OR phase = 'waiting_approval'", name="waiting_since_only_while_waiting"),
    Index("ix_agents_listing", "created_at", "id"),  # newest first, keyset-paginated (scanned backwards)
    # The approvals inbox and the approval-timeout pass start from the agents waiting for a person.
    Index("ix_agents_waiting", "id", postgresql_where=text("phase = 'waiting_approval'")),
    # The console's list, a page at a time (models/console_sql.py): those waiting longest first (by when their wait
    # began), then per phase newest first.
    Index(
        "ix_agents_waiting_since",
        text("coalesce(waiting_since, updated_at)"),
        "id",
        postgresql_where=text("phase = 'waiting_approval' AND archived_at IS NULL"),
    ),
    Index("ix_agents_by_phase", "phase", "created_at", "id", postgresql_where=text("archived_at IS NULL")),
    # A list scoped to a token's name prefix (starts_with(name, …)) reads the agents under it (migration 0025).
    Index("ix_agents_name_prefix", "name", postgresql_ops={"name": "text_pattern_ops"}),
    # The deadline pass (models/deadlines_sql.py): active agents by the deadline they pass, a batch at a time.
    Index(
        "ix_agents_hard_deadline",
        "hard_deadline",
        "id",
        postgresql_where=text(f"{_ACTIVE_PHASES} AND hard_deadline IS NOT NULL"),
    ),
    Index(
        "ix_agents_soft_deadline",
        "soft_deadline",
        "id",
        postgresql_where=text(f"{_ACTIVE_PHASES} AND priority = 'normal' AND soft_deadline IS NOT NULL"),
    ),
)

#: Tables whose rows outlive a deleted agent (its story: the journal, and what its requests did). Instead of a
#: foreign key to ``agents``, a trigger (``keel_agent_exists``, migration 0006; for the journal its append guard since
#: 0029) refuses a row whose agent does not exist when it is written; ``schedules`` keeps its foreign key: an agent's
#: schedules go with it.
KEPT_AFTER_DELETE: tuple[str, ...] = ("requests", "audit.journal", "jobs", "outbox")

# One row per request ever submitted, per agent: a request id is its agent's own (migration 0028), so one tenant's
# ids can neither occupy nor reveal another's; kept after its agent is deleted.
requests = Table(
    "requests",
    metadata,
    Column("agent_id", UUID(as_uuid=True), primary_key=True),  # KEPT_AFTER_DELETE
    Column("request_id", Text, primary_key=True, index=True),
    Column("input", JSONB, nullable=False),
    Column("actor", Text, nullable=False),
    Column("submitted_at", DateTime(timezone=True), nullable=False),
    Column("traceparent", Text),  # W3C trace context of the submit: the request's trace
    # Retention (migration 0021): once pruned the input is JSON null and its digest is what a repeated submit is
    # compared with; a trigger allows that one change and no other.
    Column("input_sha256", Text),
    Column("pruned_at", DateTime(timezone=True)),
    CheckConstraint("pruned_at IS NULL OR input_sha256 IS NOT NULL", name="pruned_keeps_digest"),
    Index("ix_requests_unpruned", "submitted_at", postgresql_where=text("pruned_at IS NULL")),
)

#: Partitioned by month of ``at`` (migration 0017, docs/audit-retention.md): the primary key must hold the partition
#: key, and ``(agent_id, seq)`` is unique per partition only (each has its own index); the guards on the table keep
#: both unique across months. ``id`` has no default: the append guard draws it from ``audit.journal_id_seq`` and
#: refuses a row that brings its own.
journal = Table(
    "journal",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=False),
    Column("agent_id", UUID(as_uuid=True), nullable=False),  # KEPT_AFTER_DELETE
    Column("seq", BigInteger, nullable=False),
    Column("kind", Text, nullable=False),
    Column("event", Text, nullable=False),
    Column("actor", Text, nullable=False),
    Column("request_id", Text),
    Column("from_phase", Text),
    Column("to_phase", Text),
    Column("revision", BigInteger, nullable=False),
    Column("decision", Text, nullable=False),
    # json, not jsonb: the stored text is exactly the text that was hashed.
    Column("details", JSON, nullable=False),
    Column("at", DateTime(timezone=True), primary_key=True),
    Column("prev_hash", Text, nullable=False),
    # An HMAC-SHA256 (agents/core/journal/chain.py) under the audit key ``key_id``; a legacy event, written before the
    # journal was keyed (migration 0015), has no key id and a plain sha256 here.
    Column("hash", Text, nullable=False),
    Column("key_id", Text),
    CheckConstraint(_in("kind", JOURNAL_KINDS), name="kind"),
    CheckConstraint("seq >= 1", name="seq_positive"),
    Index(None, "request_id"),
    schema=AUDIT_SCHEMA,
    postgresql_partition_by="RANGE (at)",
)

#: The journal's partitions: ``journal_legacy`` (everything before migration 0017's month boundary) and one per month,
#: ``journal_YYYY_MM``, created by ``audit.keel_ensure_partitions``. Not in the metadata: they are the parent's.
JOURNAL_PARTITION = re.compile(r"^journal_(legacy|\d{4}_\d{2})$")

#: One tombstone per deleted agent, insert-only: the agent as it was deleted and the head of its journal chain (its
#: ``operator``/``delete`` event), which `keel audit verify` checks the chain against. Written only together with the
#: deletion, for an archived agent at rest (triggers, migration 0006).
deleted_agents = Table(
    "deleted_agents",
    metadata,
    Column("agent_id", UUID(as_uuid=True), primary_key=True),
    Column("name", Text, nullable=False, index=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("deleted_at", DateTime(timezone=True), nullable=False),
    Column("deleted_by", Text, nullable=False),
    Column("phase", Text, nullable=False),
    Column("revision", BigInteger, nullable=False),
    Column("request_id", Text),
    Column("journal_seq", BigInteger, nullable=False),
    Column("journal_head", Text, nullable=False),
    Index("ix_deleted_agents_name_prefix", "name", postgresql_ops={"name": "text_pattern_ops"}),  # 0025
    schema=AUDIT_SCHEMA,
)

#: The chains that had events when the journal was keyed (migration 0015): each one's length and head then, sealed
#: with an HMAC under the audit key ``key_id``. Those events, and no others, may be unkeyed (legacy). Written once, by
#: that migration; triggers refuse any change after it.
legacy_chains = Table(
    "legacy_chains",
    metadata,
    Column("agent_id", UUID(as_uuid=True), primary_key=True),
    Column("seq", BigInteger, nullable=False),
    Column("head", Text, nullable=False),
    Column("key_id", Text, nullable=False),
    Column("seal", Text, nullable=False),
    schema=AUDIT_SCHEMA,
)

#: One sealed row per month of the journal `keel audit archive` removed once every event in it was shipped and
#: verified (agents/audit/archive.py): verify starts each chain from the newest record's head for it. Insert-only.
archived_partitions = Table(
    "archived_partitions",
    metadata,
    Column("partition", Text, primary_key=True),
    Column("from_at", DateTime(timezone=True), nullable=True),  # NULL: from the journal's start (the legacy part)
    Column("to_at", DateTime(timezone=True), nullable=False),
    Column("first_id", BigInteger, nullable=True),
    Column("last_id", BigInteger, nullable=True),
    Column("events", BigInteger, nullable=False),
    Column("manifests", JSONB, nullable=False),
    Column("heads", JSONB, nullable=False),
    Column("archived_by", Text, nullable=False),
    Column("archived_at", DateTime(timezone=True), nullable=False),
    Column("key_id", Text, nullable=False),
    Column("seal", Text, nullable=False),
    CheckConstraint(
        "(events = 0 AND first_id IS NULL AND last_id IS NULL) OR (events > 0 AND first_id <= last_id)", name="range"
    ),
    schema=AUDIT_SCHEMA,
)

#: Every claim of a job takes the next value: a worker holding an older token can no longer write the job.
fencing_tokens = Sequence("job_fencing_token_seq", metadata=metadata)

jobs = Table(
    "jobs",
    metadata,
    Column("key", Text, primary_key=True),  # {request}:{operation}:{target}, also the Celery task id
    Column("agent_id", UUID(as_uuid=True), nullable=False),  # KEPT_AFTER_DELETE
    Column("request_id", Text, nullable=False),
    Column("operation", Text, nullable=False),
    Column("target", Text, nullable=False),
    Column("payload", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("status", Text, nullable=False, server_default="pending"),
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False, server_default="5"),
    Column("run_at", DateTime(timezone=True), nullable=False),
    Column("attempts", Integer, nullable=False, server_default="0"),
    # Failures so far per error class, e.g. {"transient": 2}: each class has its own cap.
    Column("error_attempts", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("fencing_token", BigInteger, nullable=False, server_default="0"),
    Column("lease_until", DateTime(timezone=True)),
    Column("worker", Text),
    Column("last_error", Text),
    Column("error_class", Text),
    Column("result", JSONB),
    Column("tokens", BigInteger, nullable=False, server_default="0"),
    Column("cost", Money, nullable=False, server_default="0"),
    # Spend of attempts that failed: the retry-caused cost.
    Column("failed_tokens", BigInteger, nullable=False, server_default="0"),
    Column("failed_cost", Money, nullable=False, server_default="0"),
    Column("suppressed", Integer, nullable=False, server_default="0"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("enqueued_at", DateTime(timezone=True)),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    Column("traceparent", Text),  # W3C trace context of the request that caused the job
    CheckConstraint(_in("status", JOB_STATUSES), name="status"),
    CheckConstraint(
        "attempts >= 0 AND tokens >= 0 AND cost >= 0 AND failed_tokens >= 0 AND failed_cost >= 0", name="non_negative"
    ),
    CheckConstraint("status <> 'running' OR lease_until IS NOT NULL", name="running_has_lease"),
    CheckConstraint(_in("queue", JOB_QUEUES), name="queue"),  # 0027
    # Live jobs by status, then due time: the KPI scrape's counts and oldest due job (a scan by due time alone would
    # walk every enqueued job waiting its turn).
    Index("ix_jobs_due", "status", "run_at", postgresql_where=text("status IN ('pending', 'enqueued', 'running')")),
    # Retention's batches, oldest first (models/retention_sql.py).
    Index("ix_jobs_finished", "finished_at", postgresql_where=text(_in("status", JOB_FINAL))),
    # An agent's live jobs: counted under every transition's lock, swept when it comes to rest.
    Index("ix_jobs_agent_live", "agent_id", postgresql_where=text("status IN ('pending', 'enqueued', 'running')")),
    # A request's gates, latest first: the call an agent waiting for approval waits on (models/approvals_sql.py).
    Index(
        "ix_jobs_gates",
        "request_id",
        "finished_at",
        postgresql_where=text("operation = 'gate' AND status = 'succeeded'"),
    ),
    # A request's jobs in order: a plan step's conversation, a waiting agent's approval, superseding a round.
    Index("ix_jobs_request", "request_id", "created_at", "key"),
    # The dispatcher's three cases, each read a batch at a time (models/dispatch_sql.py take_due): new jobs due, by
    # priority; enqueued ones never claimed; running ones whose lease expired.
    Index("ix_jobs_pending", "queue", "priority", "run_at", postgresql_where=text("status = 'pending'")),
    Index("ix_jobs_enqueued", "queue", "enqueued_at", postgresql_where=text("status = 'enqueued'")),
    Index("ix_jobs_leased", "queue", "lease_until", postgresql_where=text("status = 'running'")),
)

schedules = Table(
    "schedules",
    metadata,
    Column("name", Text, primary_key=True),
    Column("agent_id", UUID(as_uuid=True), ForeignKey("agents.id"), nullable=False),
    Column("every_seconds", Integer),
    Column("cron", Text),
    Column("operation", Text, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("enabled", Boolean, nullable=False, server_default=text("true")),
    Column("next_fire_at", DateTime(timezone=True), nullable=False),
    Column("last_fire_at", DateTime(timezone=True)),
    Column("last_outcome", Text),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("(every_seconds IS NULL) <> (cron IS NULL)", name="interval_or_cron"),
    CheckConstraint("every_seconds IS NULL OR every_seconds > 0", name="every_positive"),
    Index("ix_schedules_due", "next_fire_at", "name", postgresql_where=text("enabled")),
)

outbox = Table(
    "outbox",
    metadata,
    # {request}:{channel}:{target}; also the marker at the receiver. Keel's own messages read
    # alert:{name}:{episode start}:{firing|resolved} and kpi:daily-report:{date} (their 2nd segment is never a channel)
    Column("key", Text, primary_key=True),
    Column("seq", BigInteger, Identity(always=True), nullable=False, unique=True),  # creation order
    # KEPT_AFTER_DELETE; NULL only for Keel's own messages (SYSTEM_REQUEST_IDS: alerts, the KPI report)
    Column("agent_id", UUID(as_uuid=True)),
    Column("request_id", Text, nullable=False),
    Column("channel", Text, nullable=False),
    Column("destination", Text, nullable=False),  # Slack channel; GitHub owner/repo#number
    Column("payload", JSONB, nullable=False),
    Column("status", Text, nullable=False, server_default="pending"),
    Column("attempts", Integer, nullable=False, server_default="0"),  # rate-limited attempts aside
    Column("rate_limited_attempts", Integer, nullable=False, server_default="0"),  # KEEL_OUTBOX_MAX_RATE_LIMITED
    Column("next_attempt_at", DateTime(timezone=True), nullable=False),
    Column("lease_until", DateTime(timezone=True)),
    Column("claim_token", BigInteger, nullable=False, server_default="0"),
    # The previous attempt's outcome is unknown: ask the receiver before sending again.
    Column("needs_reconcile", Boolean, nullable=False, server_default=text("false")),
    Column("last_error", Text),
    Column("external_id", Text),  # Slack ts; GitHub comment id
    Column("external_url", Text),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("sent_at", DateTime(timezone=True)),
    Column("traceparent", Text),  # W3C trace context of the request that caused the message
    CheckConstraint(_in("status", OUTBOX_STATUSES), name="status"),
    CheckConstraint(_in("channel", CHANNELS), name="channel"),
    CheckConstraint("status <> 'sent' OR external_id IS NOT NULL", name="sent_has_external_id"),
    CheckConstraint(f"agent_id IS NOT NULL OR {_in('request_id', SYSTEM_REQUEST_IDS)}", name="system_message"),
    Index("ix_outbox_line", "destination", "seq", postgresql_where=text("status IN ('pending', 'sending')")),
    Index("ix_outbox_dead", "channel", postgresql_where=text("status = 'dead'")),  # dead letters per channel (KPIs)
    Index("ix_outbox_dead_agent", "agent_id", postgresql_where=text("status = 'dead'")),  # an agent's dead ones
    Index("ix_outbox_request", "agent_id", "request_id", "seq"),  # a request's messages in order (its outcome, story)
    # The console's Outbox page: what is not sent yet, newest first, a page at a time (sent messages are most rows).
    Index("ix_outbox_unsent", "seq", postgresql_where=text("status IN ('pending', 'sending', 'dead')")),
    Index("ix_outbox_sent", "sent_at", postgresql_where=text("status = 'sent'")),  # retention's batches, oldest first
)

#: Append-only: one row per confirmed delivery (sent, or found at the receiver by reconciliation).
delivery_log = Table(
    "delivery_log",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    # A confirmation goes with its message when retention prunes it (and only then: a trigger, migration 0021).
    Column("key", Text, ForeignKey("outbox.key", ondelete="CASCADE"), nullable=False, index=True),
    Column("external_id", Text, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("how", Text, nullable=False),
    Column("confirmed_at", DateTime(timezone=True), nullable=False),
    CheckConstraint("how IN ('sent', 'reconciled')", name="how"),
)

#: What retention pruned: one row per job or message key (kind ``job`` / ``message``), written by a trigger on the
#: DELETE. An insert of a key found here is skipped (another trigger), so it counts as a suppressed duplicate.
pruned_keys = Table(
    "pruned_keys",
    metadata,
    Column("kind", Text, primary_key=True),
    Column("key", Text, primary_key=True),
    Column("agent_id", UUID(as_uuid=True)),  # NULL for Keel's own messages; a redelivered job's suppression names it
    Column("pruned_at", DateTime(timezone=True), nullable=False),
    CheckConstraint("kind IN ('job', 'message')", name="kind"),
)

#: The HTTP ingress's API tokens. Only a hash of each secret is stored; a token is never deleted, only revoked (a
#: trigger, migration 0007, keeps every column but ``last_used_at`` as written, and a revocation for good).
api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    Column("name", Text, nullable=False, unique=True),
    Column("scopes", ARRAY(Text), nullable=False),
    # The token sees only agents whose name starts with this (NULL: every agent).
    Column("agent_prefix", Text),
    # sha256 of the secret, hex: what a request's secret is looked up by.
    Column("secret_hash", Text, nullable=False, unique=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("created_by", Text, nullable=False),
    Column("last_used_at", DateTime(timezone=True)),  # at most a minute behind (written at most once a minute)
    Column("revoked_at", DateTime(timezone=True)),
    Column("revoked_by", Text),
    CheckConstraint(f"char_length(name) BETWEEN 1 AND {MAX_NAME_CHARS}", name="name_length"),
    CheckConstraint(f"name ~ '{NAME_PATTERN}'", name="name_pattern"),
    CheckConstraint(
        "cardinality(scopes) >= 1 AND array_ndims(scopes) = 1"
        f" AND scopes <@ ARRAY[{', '.join(repr(s) for s in TOKEN_SCOPES)}]",
        name="scopes",
    ),
    CheckConstraint(
        f"agent_prefix IS NULL OR (char_length(agent_prefix) BETWEEN 1 AND {MAX_NAME_CHARS}"
        f" AND agent_prefix ~ '{NAME_PATTERN}')",
        name="agent_prefix",
    ),
    CheckConstraint("secret_hash ~ '^[0-9a-f]{64}$'", name="secret_hash_sha256"),
    CheckConstraint("(revoked_at IS NULL) = (revoked_by IS NULL)", name="revoked_by_whom"),
)

#: Insert-only: one row per counter a transaction moves (migration 0008 says why), written by triggers (migration
#: 0009); the leading beat folds them into ``kpi_rollups`` and deletes them in one transaction (models/kpi_sql.py).
kpi_deltas = Table(
    "kpi_deltas",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("name", Text, nullable=False),
    Column("label", Text, nullable=False, server_default=""),
    Column("value", Numeric, nullable=False),  # exact: see migration 0008
)

#: Per-minute sums of the deltas, and one running total per counter at bucket ``-infinity``.
kpi_rollups = Table(
    "kpi_rollups",
    metadata,
    Column("name", Text, primary_key=True),
    Column("label", Text, primary_key=True, server_default=""),
    Column("bucket", DateTime(timezone=True), primary_key=True),
    Column("value", Numeric, nullable=False),
    Index("ix_kpi_rollups_bucket", "bucket"),
)

#: One row per firing of an alert; at most one open (unresolved) episode per alert.
alert_episodes = Table(
    "alert_episodes",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("name", Text, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("resolved_at", DateTime(timezone=True)),
    Column("value", Float),  # the measure when the episode opened
    Column("threshold", Float),
    Column("last_value", Float),
    Column("last_evaluated_at", DateTime(timezone=True), nullable=False),
    Column("details", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    CheckConstraint("resolved_at IS NULL OR resolved_at >= started_at", name="resolved_after_start"),
    UniqueConstraint("name", "started_at"),
    Index("ix_alert_episodes_open", "name", unique=True, postgresql_where=text("resolved_at IS NULL")),
)

#: One row per leadership term of the beat: who led, since when, its last tick (database clock), and how long nobody
#: led before it began (NULL for the first term ever).
beat_terms = Table(
    "beat_terms",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("leader", Text, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False, index=True),
    Column("last_tick_at", DateTime(timezone=True), nullable=False),
    Column("gap_seconds", Float),
)

#: When the leading beat last ran each periodic chore (alerts, audit verify, KPI report), on the database's clock.
beat_chores = Table(
    "beat_chores",
    metadata,
    Column("name", Text, primary_key=True),
    Column("last_run_at", DateTime(timezone=True), nullable=False),
)

#: The beat leader's lease (tasks/leadership.py): who holds it, its term (+1 on every change of hands: a fencing
#: number) and until when, on the database's clock.
beat_leadership = Table(
    "beat_leadership",
    metadata,
    Column("name", Text, primary_key=True),
    Column("holder", Text, nullable=False),
    Column("term", BigInteger, nullable=False),
    Column("acquired_at", DateTime(timezone=True), nullable=False),
    Column("lease_until", DateTime(timezone=True), nullable=False),
    CheckConstraint("term > 0", name="term_positive"),
)

#: The outcome of every `keel audit verify`: the command's (source cli) and the leading beat's (source beat).
audit_verifications = Table(
    "audit_verifications",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("source", Text, nullable=False),
    Column("ok", Boolean, nullable=False),
    Column("agents", BigInteger, nullable=False),
    Column("events", BigInteger, nullable=False),
    Column("breaks", BigInteger, nullable=False),
    Column("details", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # An HMAC of the row under the audit key ring (models/audit_records.py): a row without a seal that holds was not
    # written by Keel. Unique, so a genuine row cannot be inserted again in front of later ones.
    Column("key_id", Text, nullable=False),
    Column("seal", Text, nullable=False, unique=True),
    CheckConstraint("source IN ('cli', 'beat')", name="source"),
)

#: One row per journal segment confirmed in the separate store (`keel audit ship`), per destination: how far shipping
#: has got (sealed: see models/audit_records.py). Written only after the store holds the segment and its manifest;
#: the store is the authority on resume.
audit_shipments = Table(
    "audit_shipments",
    metadata,
    Column("destination", Text, primary_key=True),
    Column("first_id", BigInteger, nullable=False),
    Column("last_id", BigInteger, primary_key=True),
    Column("events", BigInteger, nullable=False),
    Column("segment", Text, nullable=False),  # the body's object name
    # In the key, so that a forged row claiming a segment cannot take the place of the genuine one.
    Column("manifest_sha256", Text, primary_key=True),
    Column("shipped_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    # An HMAC of the row under the audit key ring (models/audit_records.py); readers pass over a row whose seal fails.
    Column("key_id", Text, nullable=False),
    Column("seal", Text, nullable=False),
    CheckConstraint("first_id <= last_id", name="range"),
)

#: How far `keel audit verify` has verified each chain (its last verified event, that event's link and the walk's
#: state there), so an incremental pass reads only the events after it. Sealed, and marked where a chain broke
#: (``broken_seq``): docs/explanation/storage-and-jobs.md#sealed-audit-records.
audit_verified_chains = Table(
    "audit_verified_chains",
    metadata,
    Column("agent_id", UUID(as_uuid=True), primary_key=True),
    Column("seq", BigInteger, nullable=False),
    Column("hash", Text, nullable=False),
    Column("revision", BigInteger, nullable=False),
    Column("phase", Text),
    Column("request_id", Text),
    Column("keyed_at", BigInteger, nullable=False),
    Column("deleted_at", BigInteger, nullable=False),
    Column("legacy", BigInteger, nullable=False),
    Column("verified_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("key_id", Text, nullable=False),
    Column("seal", Text, nullable=False),
    Column("broken_seq", BigInteger),
    CheckConstraint("seq >= 1", name="seq_positive"),
)

# Console sessions signed out before they expired (the session cookie is signed, not stored: a copy of it would
# otherwise work until it expires). Kept until the session would have expired; sign-outs purge the expired rows.
console_signouts = Table(
    "console_signouts",
    metadata,
    Column("session_id", Text, primary_key=True),  # sha256 of the session's random CSRF token, hex
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Index("ix_console_signouts_expires_at", "expires_at"),
)
