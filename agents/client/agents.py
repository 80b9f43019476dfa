"""The direct client's agents: create, read, list, name, archive and delete them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from decimal import Decimal
from uuid import UUID

from pydantic import ValidationError
from sqlalchemy import select, tuple_

from agents.client.base import ClientBase
from agents.client.checks import AgentRef, check_actor, check_reason
from agents.client.cursors import decode_cursor, encode_cursor
from agents.core import transition as core
from agents.core.commands import MAX_BIGINT, check_count, check_text
from agents.core.errors import InvalidInput
from agents.core.phases import Phase
from models.schemas import AgentPage, AgentRow, AgentState, DeletedAgent, NewAgent
from models.tables import agents, deleted_agents


class AgentsMixin(ClientBase):
    def create_agent(
        self,
        name: str,
        *,
        budget_tokens: int | None = None,
        budget_cost: Decimal | float | str | None = None,
        actor: str = "client",
    ) -> AgentState:
        """Create an idle agent at revision 0. Budgets of None mean unlimited."""
        check_text("name", name)
        check_actor(actor)
        try:
            spec = NewAgent.model_validate({"name": name, "budget_tokens": budget_tokens, "budget_cost": budget_cost})
        except ValidationError as exc:
            raise InvalidInput(f"cannot create agent: {_first_error(exc)}") from None
        row = core.create_agent(
            self.db, spec.name, budget_tokens=spec.budget_tokens, budget_cost=spec.budget_cost, actor=actor
        )
        return AgentState.of(row)

    def agent_row(self, agent: AgentRef) -> AgentRow:
        """The agent's row by id or name, without its jobs (one query). Raises :class:`AgentNotFound`, with the
        tombstone of a deleted agent."""
        return self._row(agent)

    def get_state(self, agent: AgentRef) -> AgentState:
        """The agent's current state, by id or name, with its pending jobs."""
        return self._state(self._row(agent))

    def list_agents(
        self,
        *,
        phases: Sequence[str] = (),
        archived: bool = False,
        limit: int | None = None,
        after: str | None = None,
        name_prefix: str | None = None,
    ) -> AgentPage:
        """Agents newest first, in use (or only archived ones), filtered by ``phases`` and ``name_prefix`` if given.
        At most ``limit`` (None: all); ``after`` is the previous page's ``next``."""
        unknown = sorted(set(phases) - {p.value for p in Phase})
        if unknown:
            raise InvalidInput(f"phase {unknown[0]!r} is not one of {', '.join(p.value for p in Phase)}")
        if limit is not None:
            check_count("limit", limit, low=1, high=MAX_BIGINT - 1)  # one more is read to tell whether more follow
        query = select(agents).order_by(agents.c.created_at.desc(), agents.c.id.desc())
        query = query.where(agents.c.archived_at.is_not(None) if archived else agents.c.archived_at.is_(None))
        if phases:
            query = query.where(agents.c.phase.in_(list(phases)))
        if name_prefix:
            check_text("name_prefix", name_prefix, limit=200)
            query = query.where(agents.c.name.startswith(name_prefix, autoescape=True))
        if after is not None:
            created_at, agent_id = decode_cursor(after)
            query = query.where(tuple_(agents.c.created_at, agents.c.id) < tuple_(created_at, agent_id))
        if limit is not None:
            query = query.limit(limit + 1)  # one more tells whether there is a next page
        with core.store_errors(), self.db.engine.connect() as conn:
            rows = [AgentRow(**r._mapping) for r in conn.execute(query)]
            conn.commit()  # a read: see models.db.end_read
        more = limit is not None and len(rows) > limit
        rows = rows[:limit] if limit is not None else rows
        return AgentPage(
            agents=tuple(AgentState.of(r) for r in rows),
            next=encode_cursor(rows[-1].created_at, rows[-1].id) if more else None,
        )

    def agent_names(self, ids: Iterable[UUID]) -> dict[UUID, str]:
        """The names of these agents (archived ones included; a deleted one as ``NAME (deleted)``)."""
        wanted = list(set(ids))
        if not wanted:
            return {}
        gone = deleted_agents.c
        with core.store_errors(), self.db.engine.connect() as conn:
            names = {
                r.id: f"{r.name} (deleted)"
                for r in conn.execute(select(gone.agent_id.label("id"), gone.name).where(gone.agent_id.in_(wanted)))
            }
            rows = conn.execute(select(agents.c.id, agents.c.name).where(agents.c.id.in_(wanted)))
            found = names | {r.id: r.name for r in rows}
            conn.commit()  # a read: see models.db.end_read
        return found

    def archive(self, agent_id: AgentRef, *, actor: str) -> AgentState:
        """Archive a resting agent: it refuses new requests and is left out of ``list_agents``; its row and journal
        stay. Raises ``AgentBusy`` while a request is in flight; archiving it again changes nothing."""
        check_actor(actor)
        return self._state(core.set_archived(self.db, self._row(agent_id).id, archived=True, actor=actor))

    def unarchive(self, agent_id: AgentRef, *, actor: str) -> AgentState:
        """Put an archived agent back in use."""
        check_actor(actor)
        return self._state(core.set_archived(self.db, self._row(agent_id).id, archived=False, actor=actor))

    def delete_agent(
        self,
        agent: AgentRef,
        *,
        actor: str,
        expected_revision: int | None = None,
        reason: str | None = None,
    ) -> DeletedAgent:
        """Delete an archived agent at rest; its name is free again, its journal and requests stay. Returns its
        tombstone. Raises ``StaleRevision`` or ``AgentInUse`` (journaled). See
        docs/explanation/clients.md#archived-and-deleted-agents."""
        check_actor(actor)
        check_reason(reason)
        if expected_revision is not None:
            check_count("expected_revision", expected_revision)
        return core.delete_agent(
            self.db, self._row(agent).id, actor=actor, reason=reason, expected_revision=expected_revision
        )


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "input"
    return f"{field}: {err['msg']}"
