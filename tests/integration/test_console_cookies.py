"""Hostile bytes in every cookie the console reads, sent raw to a real ``keel serve``: a clean refusal or a redirect
to the sign-in form, never a 500 or a traceback in the log. The cookies are enumerated from the code: a new cookie
the console reads without naming it in ``sessions.COOKIES`` fails the first test here."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import agents
from agents.ingress.console import sessions
from agents.ingress.console.routes import console_routes
from tests.support.api import Api
from tests.support.console import Browsers, csrf_of

pytestmark = pytest.mark.integration


@pytest.fixture
def browsers(api: Api) -> Iterator[Browsers]:
    found = Browsers(api)
    yield found
    found.close()


#: Values that are not ASCII where the signature is compared (a ``body.mac`` shape reaches the comparison).
HOSTILE = (b"e30.\xff\xfe", b"e30.\xc3\xa9" + b"0" * 62, b"\xe2\x82\xac.\xe2\x82\xac", b"\x80")


def _names_read() -> set[str]:
    names: set[str] = set()
    root = Path(agents.__file__).parent
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            arg: ast.expr | None = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                target = node.func.value
                if isinstance(target, ast.Attribute) and target.attr == "cookies" and node.args:
                    arg = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
                if node.value.attr == "cookies":
                    arg = node.slice
            if arg is None:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            assert isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name), f"{where}: name it in sessions"
            assert arg.value.id == "sessions", f"{where}: a cookie's name must be one of sessions.COOKIES"
            names.add(getattr(sessions, arg.attr))
    return names


def test_every_cookie_the_console_reads_or_sets_is_in_the_list_the_tests_use(api: Api, browsers: Browsers) -> None:
    read = _names_read()
    assert read == set(sessions.COOKIES), f"read {sorted(read)}, listed {sessions.COOKIES}"
    client, answer = browsers.sign_in(api.token("approver"))
    set_names = {v.split("=", 1)[0] for k, v in answer.headers.multi_items() if k == "set-cookie"}
    assert set_names <= set(sessions.COOKIES) and set(client.cookies) <= set(sessions.COOKIES)


def _paths() -> list[tuple[str, str]]:
    """Every console route, its path parameters filled in."""
    found = []
    for route in console_routes():
        path = route.path.replace("{ref}", "nobody")
        found.extend((method, path) for method in sorted(route.methods))
    return found


@pytest.mark.parametrize("cookie", sessions.COOKIES)
def test_a_cookie_that_is_not_ascii_is_refused_cleanly_on_every_page(api: Api, browsers: Browsers, cookie: str) -> None:
    form_page = browsers.new().get("/signin")
    form = {"csrf": csrf_of(form_page), "token": api.token("approver"), "next": "/agents", "key": "x"}
    with httpx.Client(base_url=api.url, timeout=30) as raw:
        for value in HOSTILE:
            for method, path in _paths():
                for accept in ("text/html", "text/event-stream"):
                    headers = {"Cookie": f"{cookie}=".encode() + value, "Accept": accept}
                    if method == "GET":
                        answer = raw.get(path, headers=headers)
                    else:
                        answer = raw.post(path, headers=headers, data=form)
                    where = f"{method} {path} {cookie}={value!r} ({accept}): {answer.status_code}"
                    assert answer.status_code in (200, 303, 401, 403), where
                    if answer.status_code == 200:
                        assert path == "/signin" and "Sign in" in answer.text, where
                    if answer.status_code == 303:
                        assert answer.headers["location"].startswith("/signin" if path != "/" else "/agents"), where
                    assert sessions.SESSION_COOKIE + "=" not in answer.headers.get("set-cookie", ""), where
    log = api.log()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]
