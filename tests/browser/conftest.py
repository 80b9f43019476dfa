"""The console in a real browser: headless Chromium from Debian's ``chromium`` package, driven by Playwright (no
browser download), against a real ``keel serve``, worker and beat on the test's own database and Redis prefix.

Without Chromium or Playwright these tests cannot run: in CI (``CI=true``) that fails loudly; elsewhere each test is
skipped with the reason and the fix (``-ra`` lists them), never silently."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agents.demo.fake_servers import FakeGitHub
from models.db import Database
from tests.support.api import Api, running_api
from tests.support.audit import clean_env
from tests.support.broker import Broker

ROOT = Path(__file__).resolve().parents[2]
KEEL = str(Path(sys.executable).parent / "keel")
CHROMIUM = os.environ.get("KEEL_TEST_CHROMIUM", "/usr/bin/chromium")
#: Screenshots of every page the tests visit, for a reviewer to look at (git ignores the folder).
ARTIFACTS = ROOT / "artifacts"
GITHUB_TOKEN = "ghp_browserTest5ecretToken"
FAST = {
    "KEEL_JOB_LEASE_SECONDS": "5",
    "KEEL_DISPATCH_INTERVAL_SECONDS": "0.2",
    "KEEL_DEADLINE_CHECK_SECONDS": "0.5",
    "KEEL_KPI_FOLD_SECONDS": "1",
}


def _cannot_run(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser tests cannot run in CI: {reason}", pytrace=False)
    pytest.skip(f"browser tests cannot run here: {reason}")


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """A headless Chromium (Debian's package) under Playwright. Module-scoped, not session-scoped: Playwright's sync
    API leaves its event loop marked as running in this thread until it stops, and every later test that runs an
    event loop (asyncio.run, the ASGI test client) would fail."""
    if shutil.which(CHROMIUM) is None:
        _cannot_run(f"{CHROMIUM} is missing: apt-get install chromium (or set KEEL_TEST_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _cannot_run("the playwright package is missing: pip install -e '.[dev]'")
    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield browser
        finally:
            browser.close()
    try:  # the tests after these run event loops of their own: none may be left running in this thread
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise AssertionError("Playwright left its event loop running in the test thread")


@dataclass
class RefusingGitHub(FakeGitHub):
    """A fake GitHub that refuses every comment for good (422) while ``refusing``: the outbox's message is dead."""

    refusing: bool = False

    def create(self, request: Any, destination: str, body: dict[str, Any]) -> None:
        if self.refusing:
            return self.reply(request, 422, {"message": "Validation Failed", "errors": [{"field": "body"}]})
        return super().create(request, destination, body)


@pytest.fixture
def github() -> Iterator[RefusingGitHub]:
    fake = RefusingGitHub(token=GITHUB_TOKEN)
    fake.start()
    yield fake
    fake.stop()


@dataclass
class Stack:
    api: Api
    github: RefusingGitHub


def _start(name: str, args: list[str], env: dict[str, str], logs: Path) -> subprocess.Popen[bytes]:
    with open(logs / f"{name}.log", "ab") as log:
        return subprocess.Popen([KEEL, *args], env=env, stdout=log, stderr=log, cwd=logs, start_new_session=True)


def wait_until(what: str, predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.2)
    return value


@pytest.fixture
def stack(
    chromium: Any, db: Database, db_url: str, broker: Broker, github: RefusingGitHub, tmp_path: Path
) -> Iterator[Stack]:
    """``keel serve``, one worker and one beat on this test's database, Slack-less, GitHub pointed at the fake."""
    env = {
        **FAST,
        "KEEL_GITHUB_TOKEN": GITHUB_TOKEN,
        "KEEL_GITHUB_API_URL": github.url,
        "KEEL_IMPORTS": json.dumps(["tests.support.handlers", "tests.support.approval_tools"]),
    }
    child = clean_env()
    child.update({"KEEL_DATABASE_URL": db_url, **broker.env, "PYTHONPATH": str(ROOT), **env})
    procs = [
        _start("worker", ["worker", "-c", "1", "-n", "browser@%h", "-l", "info"], child, tmp_path),
        _start("beat", ["beat", "-l", "info"], child, tmp_path),
    ]
    try:
        wait_until("the worker", lambda: b"ready." in (tmp_path / "worker.log").read_bytes())
        with running_api(db, db_url, broker, tmp_path, env=env) as api:
            yield Stack(api, github)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def screenshot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"console-{name}.png"), full_page=True)


#: Milliseconds the browser waits for what a live update should bring (generous: two cores shared by many).
LIVE = 60_000


def sign_in(browser: Any, stack: Stack, secret: str) -> Any:
    """A new browser session (its own cookies) signed in with ``secret``, on the agents page."""
    page = browser.new_context().new_page()
    page.goto(f"{stack.api.url}/signin")
    page.get_by_label("API token").fill(secret)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("**/agents")
    return page


def tab_to(page: Any, name: str) -> None:
    """Press Tab until the control named ``name`` has the focus: it is reachable from the keyboard."""
    for _ in range(40):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement && document.activeElement.textContent.trim()") == name:
            return
    raise AssertionError(f"{name!r} cannot be reached with Tab")


def no_sideways_scroll(page: Any) -> bool:
    """Whether the page fits its window's width (a narrow screen scrolls only up and down)."""
    return bool(page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"))
