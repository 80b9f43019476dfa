"""The 401 a request without a token gets says what to send, as written: the redaction every error text passes through
does not mask a word of it (it read "send an API token as a Bearer *** in the Authorization header")."""

from __future__ import annotations

import pytest

from agents.ingress.auth import NO_TOKEN
from tests.support.api import Api

pytestmark = pytest.mark.integration


def test_a_request_without_a_token_is_told_what_to_send_unmasked(api: Api) -> None:
    with api.http() as http:
        refused = http.get("/v1/agents")
    assert refused.status_code == 401
    assert refused.json()["detail"] == NO_TOKEN
    assert "***" not in refused.text
