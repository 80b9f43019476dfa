"""Without its extra (``pydantic-ai``, ``langgraph``), importing an integration fails with one line naming it."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_without_the_extra_the_import_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pydantic_ai", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "agents.integrations.pydantic_ai", raising=False)
    with pytest.raises(ImportError) as refused:
        importlib.import_module("agents.integrations.pydantic_ai")
    assert str(refused.value) == "Keel's Pydantic AI integration needs its extra: pip install 'keel[pydantic-ai]'"


def test_without_the_langgraph_extra_the_import_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "langgraph.graph", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "agents.integrations.langgraph", raising=False)
    with pytest.raises(ImportError) as refused:
        importlib.import_module("agents.integrations.langgraph")
    assert str(refused.value) == "Keel's LangGraph integration needs its extra: pip install 'keel[langgraph]'"
