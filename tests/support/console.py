"""Signing in to the operator console over plain HTTP (what a browser without JavaScript does)."""

from __future__ import annotations

import re

import httpx

from tests.support.api import Api

_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def csrf_of(page: httpx.Response) -> str:
    """The CSRF token a page's forms carry."""
    found = _CSRF.search(page.text)
    assert found is not None, page.text
    return found.group(1)


class Browsers:
    """Cookie-keeping HTTP clients of one API, each closed by :meth:`close`."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.clients: list[httpx.Client] = []

    def new(self) -> httpx.Client:
        client = httpx.Client(base_url=self.api.url, timeout=30, headers={"Accept": "text/html"})
        self.clients.append(client)
        return client

    def sign_in(self, secret: str) -> tuple[httpx.Client, httpx.Response]:
        """A client that filled in the sign-in form with ``secret``, and the answer to it (not followed)."""
        client = self.new()
        form = client.get("/signin")
        assert form.status_code == 200, form.text
        answer = client.post("/signin", data={"token": secret, "csrf": csrf_of(form), "next": "/agents"})
        return client, answer

    def signed_in(self, secret: str) -> httpx.Client:
        """A client signed in with ``secret``."""
        client, answer = self.sign_in(secret)
        assert answer.status_code == 303, answer.text
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
