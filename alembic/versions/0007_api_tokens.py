"""API tokens for the HTTP ingress: who may do what, to which agents.

``api_tokens`` holds one row per token: its name, scopes, an optional agent-name prefix it is limited to, the sha256
of its secret (never the secret), who created it and when, when it was last used (at most a minute behind) and who
revoked it and when. A token is never deleted, only revoked, so its row stays as the record of who made it: a
trigger keeps every column as written but ``last_used_at`` and the revocation, which is for good.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-16
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
_SCOPES = "ARRAY['producer', 'approver', 'operator', 'auditor']"

_GUARD = """
CREATE FUNCTION keel_api_tokens_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'UPDATE' THEN
        RAISE EXCEPTION 'api_tokens: % refused: a token is revoked (keel token revoke), never deleted', TG_OP
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF (NEW.id, NEW.name, NEW.scopes, NEW.agent_prefix, NEW.secret_hash, NEW.created_at, NEW.created_by)
       IS DISTINCT FROM (OLD.id, OLD.name, OLD.scopes, OLD.agent_prefix, OLD.secret_hash, OLD.created_at, OLD.created_by) THEN
        RAISE EXCEPTION 'api_tokens: token % changes only when used or revoked', OLD.name
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF OLD.revoked_at IS NOT NULL AND (NEW.revoked_at, NEW.revoked_by) IS DISTINCT FROM (OLD.revoked_at, OLD.revoked_by) THEN
        RAISE EXCEPTION 'api_tokens: token % was revoked: that is for good', OLD.name
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER api_tokens_guard BEFORE UPDATE OR DELETE ON api_tokens
    FOR EACH ROW EXECUTE FUNCTION keel_api_tokens_guard();
CREATE TRIGGER api_tokens_no_truncate BEFORE TRUNCATE ON api_tokens
    FOR EACH STATEMENT EXECUTE FUNCTION keel_api_tokens_guard();
"""


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("scopes", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("agent_prefix", sa.Text(), nullable=True),
        sa.Column("secret_hash", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("created_by", sa.Text(), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_by", sa.Text(), nullable=True),
        sa.CheckConstraint("char_length(name) BETWEEN 1 AND 200", name=op.f("ck_api_tokens_name_length")),
        sa.CheckConstraint(f"name ~ '{_NAME}'", name=op.f("ck_api_tokens_name_pattern")),
        sa.CheckConstraint(
            f"cardinality(scopes) >= 1 AND array_ndims(scopes) = 1 AND scopes <@ {_SCOPES}",
            name=op.f("ck_api_tokens_scopes"),
        ),
        sa.CheckConstraint(
            f"agent_prefix IS NULL OR (char_length(agent_prefix) BETWEEN 1 AND 200 AND agent_prefix ~ '{_NAME}')",
            name=op.f("ck_api_tokens_agent_prefix"),
        ),
        sa.CheckConstraint("secret_hash ~ '^[0-9a-f]{64}$'", name=op.f("ck_api_tokens_secret_hash_sha256")),
        sa.CheckConstraint("(revoked_at IS NULL) = (revoked_by IS NULL)", name=op.f("ck_api_tokens_revoked_by_whom")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("name", name=op.f("uq_api_tokens_name")),
        sa.UniqueConstraint("secret_hash", name=op.f("uq_api_tokens_secret_hash")),
    )
    op.execute(_GUARD)


def downgrade() -> None:
    op.drop_table("api_tokens")  # its triggers go with it
    op.execute("DROP FUNCTION keel_api_tokens_guard()")
