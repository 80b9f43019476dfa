"""Without its extra (``pydantic-ai``, ``langgraph``), importing an integration fails with one line naming it."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "missing", "extra", "framework"),
    [
        ("agents.integrations.pydantic_ai", "pydantic_ai", "pydantic-ai", "Pydantic AI"),
        ("agents.integrations.langgraph", "langgraph.graph", "langgraph", "LangGraph"),
    ],
)
def test_without_the_extra_the_import_names_it(
    monkeypatch: pytest.MonkeyPatch, module: str, missing: str, extra: str, framework: str
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as refused:
        importlib.import_module(module)
    assert str(refused.value) == f"Keel's {framework} integration needs its extra: pip install 'keel[{extra}]'"
