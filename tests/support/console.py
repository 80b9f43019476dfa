"""Signing in to the operator console over plain HTTP (what a browser without JavaScript does), an API started with
a test's own settings, and walking a list's pages by their "next" links."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from html import unescape
from pathlib import Path

import httpx

from models.db import Database
from tests.support.api import Api, running_api
from tests.support.broker import Broker

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


#: Starts ``keel serve`` with these KEEL_* settings on the test's database and Redis prefix; stopped after the test.
Serve = Callable[[dict[str, str]], Api]
Browse = Callable[[Api], Browsers]


@contextmanager
def serving(db: Database, db_url: str, broker: Broker, tmp_path: Path) -> Iterator[Serve]:
    """What a test's ``serve`` fixture hands out: every API it starts is stopped at the end."""
    with ExitStack() as stack:

        def start(env: dict[str, str]) -> Api:
            return stack.enter_context(running_api(db, db_url, broker, tmp_path, env=env))

        yield start


@contextmanager
def browsing() -> Iterator[Browse]:
    """What a test's ``browse`` fixture hands out: browsers of an API started by ``serve``, closed at the end."""
    made: list[Browsers] = []

    def of(api: Api) -> Browsers:
        made.append(Browsers(api))
        return made[-1]

    yield of
    for browsers in made:
        browsers.close()


#: A row of the agents list (its phase and name) and a page's link to the next page.
AGENT_ROW = re.compile(r'<tr class="phase-(\w+)" data-agent="([^"]+)"')
NEXT_PAGE = re.compile(r'<a href="([^"]+)" rel="next"')


def walk(client: httpx.Client, url: str, row: re.Pattern[str]) -> list[tuple[list[tuple[str, ...]], str]]:
    """Every page of a list from ``url`` by its "next" links: each page's rows and its text."""
    pages = []
    while True:
        page = client.get(url)
        assert page.status_code == 200, page.text
        pages.append(([tuple(m) if isinstance(m, tuple) else (m,) for m in row.findall(page.text)], page.text))
        found = NEXT_PAGE.search(page.text)
        if found is None:
            return pages
        url = unescape(found.group(1))
        assert len(pages) < 50, "the pages do not end"


def inbox_rows(page: httpx.Response) -> list[str]:
    """The agents of the inbox's rows, in order."""
    return re.findall(r'<tr data-call="([^"]+)"', page.text)
