"""What the API says to a request it cannot take (issue 37): the 401 without a token says what to send, unmasked by
the redaction every error text passes through (it read "as a Bearer *** in the Authorization header"); a body not
sent as JSON is refused naming the header (it was a 422 naming "body.13")."""

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


def test_a_body_that_is_not_sent_as_json_is_refused_naming_the_header(api: Api) -> None:
    with api.http(api.token("producer")) as http:
        bare = http.post("/v1/agents", content=b'{"name": "x"}')  # no Content-Type
        typed = http.post("/v1/agents", content=b'{"name": "x"}', headers={"Content-Type": "text/plain"})
        broken = http.post("/v1/agents", content=b'{"name": "x",', headers={"Content-Type": "application/json"})
        after = http.get("/v1/agents/x")
    assert bare.status_code == 422 and "Content-Type: application/json" in bare.json()["detail"]
    assert "without a Content-Type" in bare.json()["detail"]
    assert typed.status_code == 422 and "it came as 'text/plain'" in typed.json()["detail"]
    assert broken.status_code == 422 and "not valid JSON" in broken.json()["detail"], broken.text
    assert "body.13" not in bare.text + typed.text + broken.text
    assert after.status_code == 404, "a refused body created nothing"
