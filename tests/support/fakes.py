"""The fake receivers live in agents/sinks.py (the demo uses them too); tests import them from here."""

from agents.sinks import FakeGitHub, FakeLLM, FakeSlack

__all__ = ["FakeGitHub", "FakeLLM", "FakeSlack"]
