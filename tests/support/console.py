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

    def new(self, *, source: str | None = None) -> httpx.Client:
        """A client; with ``source`` its connections come from that local address (e.g. 127.0.0.2: another client
        address on this machine, as the API sees it)."""
        transport = None if source is None else httpx.HTTPTransport(local_address=source)
        client = httpx.Client(base_url=self.api.url, timeout=30, headers={"Accept": "text/html"}, transport=transport)
        self.clients.append(client)
        return client

    def sign_in(
        self, secret: str, *, client: httpx.Client | None = None, headers: dict[str, str] | None = None
    ) -> tuple[httpx.Client, httpx.Response]:
        """A client (a new one, or ``client``) that filled in the sign-in form with ``secret`` (sending ``headers``
        along), and the answer to it (not followed)."""
        client = client or self.new()
        form = client.get("/signin", headers=headers)
        assert form.status_code == 200, form.text
        answer = client.post(
            "/signin", data={"token": secret, "csrf": csrf_of(form), "next": "/agents"}, headers=headers
        )
        return client, answer

    def signed_in(self, secret: str) -> httpx.Client:
        """A client signed in with ``secret``."""
        client, answer = self.sign_in(secret)
        assert answer.status_code == 303, answer.text
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
