"""Handlers run on threads kept for the next job (agents/jobs/handler_threads.py): one thread serves job after
job, in each job's own context; a thread whose handler overran its limit is never given another job."""

from __future__ import annotations

import contextvars
import threading

from agents.jobs.handler_threads import HandlerThreads

JOB: contextvars.ContextVar[str] = contextvars.ContextVar("JOB", default="none")


def _in(job: str) -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(JOB.set, job)
    return context


def test_one_thread_serves_job_after_job_in_each_jobs_context_and_name() -> None:
    threads = HandlerThreads()
    seen: list[tuple[str, str, int]] = []

    def record() -> None:
        me = threading.current_thread()
        seen.append((JOB.get(), me.name, me.ident or 0))

    assert threads.run("keel-job-plan", _in("a"), record, 5)
    assert threads.run("keel-job-tool", _in("b"), record, 5)
    assert [(job, name) for job, name, _ in seen] == [("a", "keel-job-plan"), ("b", "keel-job-tool")]
    assert seen[0][2] == seen[1][2] != threading.get_ident(), "the second job should reuse the first one's thread"


def test_a_handler_past_its_limit_keeps_its_thread_and_the_next_job_gets_another() -> None:
    threads = HandlerThreads()
    release, idents = threading.Event(), []

    def stuck() -> None:
        idents.append(threading.get_ident())
        release.wait(10)

    try:
        assert not threads.run("keel-job-tool", _in("slow"), stuck, 0.05)
        assert threads.run("keel-job-tool", _in("next"), lambda: idents.append(threading.get_ident()), 5)
        assert idents[0] != idents[1], "a thread still running an overrun handler was given another job"
    finally:
        release.set()


def test_a_handler_that_raises_past_exception_returns_without_a_result_and_the_thread_lives() -> None:
    threads = HandlerThreads()
    ran: list[str] = []

    def exits() -> None:
        raise SystemExit(3)

    assert threads.run("keel-job-x", _in("x"), exits, 5)  # it returned (without a result: the runner's box is empty)
    assert threads.run("keel-job-y", _in("y"), lambda: ran.append(JOB.get()), 5)
    assert ran == ["y"]
