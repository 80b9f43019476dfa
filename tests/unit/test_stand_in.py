"""The stand-in model (KEEL_LLM_PROVIDER=scripted, a request without a script) and how the CLI prints what a model
or a handler wrote."""

from __future__ import annotations

import pytest

from agents.cli.request import shown
from agents.core.errors import InvalidJob
from agents.runtime import loop
from agents.runtime.inference import STAND_IN, StandInProvider
from models.settings import Settings


def test_the_stand_in_answers_once_labelled_quoting_the_prompt_and_costs_nothing() -> None:
    reply = StandInProvider().complete([{"role": "user", "content": "x" * 500}], [])
    assert reply.content is not None and reply.content.startswith(f"{STAND_IN} You asked: 'xxx")
    assert "x" * 200 not in reply.content and "…" in reply.content  # at most 199 of the prompt's characters
    assert reply.tool_calls == () and reply.usage.tokens == 0
    again = StandInProvider().complete([{"role": "user", "content": "x" * 500}], [])
    assert again == reply  # a replay after a crash gets the same answer


def test_in_production_a_request_without_a_script_is_refused_not_answered_by_the_stand_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in review: on compose (production) every plan request ended `done` with the stand-in's text."""
    production = Settings.model_construct(environment="production", llm_provider="scripted")
    monkeypatch.setattr(loop, "_settings", lambda: production)
    with pytest.raises(InvalidJob, match="stand-in model does not answer in production: set KEEL_LLM_PROVIDER=openai"):
        loop.provider_for({"prompt": "hi"})
    assert loop.provider_for({"prompt": "hi", "script": [{"content": "ok"}]}).complete([], []).content == "ok"
    development = Settings.model_construct(environment="development", llm_provider="scripted")
    monkeypatch.setattr(loop, "_settings", lambda: development)
    assert isinstance(loop.provider_for({"prompt": "hi"}), StandInProvider)


def test_text_from_a_model_cannot_move_the_terminals_cursor_and_keeps_the_value_column() -> None:
    assert shown("red \x1b[31malert\x07") == "red \\x1b[31malert\\x07"
    assert shown("line one\nline two\ttabbed") == "line one\n           line two\ttabbed"
