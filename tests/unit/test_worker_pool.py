"""What a worker runs by default, where a job is published (Keel's queues, or its operation's own), and what a
worker process builds once."""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from models.dispatch_sql import Due
from models.settings import Settings
from tasks.app import make_app, pool_name, queue_of
from tasks.runtime import PerProcess


def test_a_worker_keeps_two_hundred_steps_in_flight_in_one_process_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KEEL_WORKER_POOL", "KEEL_WORKER_CONCURRENCY"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings()
    assert (settings.worker_pool, settings.worker_slots, settings.db_pool_size_worker) == ("threads", 200, 20)
    assert Settings(worker_pool="prefork").worker_slots >= 1
    assert Settings(worker_pool="prefork", worker_concurrency=3).worker_slots == 3


#: A broker named, so that reading the app's configuration starts no embedded Redis (nothing is sent).
BROKER = "redis://127.0.0.1:1/0"


def test_every_publish_routes_an_operation_to_its_own_queue() -> None:
    celery = make_app(Settings(broker_url=BROKER, operation_queues={"summarise": "keel.cpu"}))
    assert queue_of(Due("a~r1:summarise:1", "keel.jobs", False), celery) == "keel.cpu"
    assert queue_of(Due("a~r1:summarise:1", "keel.jobs.low", False), celery) == "keel.cpu"
    assert queue_of(Due("a~r1:plan:1", "keel.jobs.low", False), celery) == "keel.jobs.low"
    assert queue_of(Due("a~r1:plan:1", "keel.jobs", False), make_app(Settings(broker_url=BROKER))) == "keel.jobs"


def test_what_a_process_holds_is_built_once_however_many_threads_ask_at_once() -> None:
    built: list[int] = []

    def build(pid: int) -> int:
        time.sleep(0.05)  # long enough for every thread to ask before the first build is done
        built.append(pid)
        return len(built)

    held = PerProcess(functools.cache(build))
    with ThreadPoolExecutor(max_workers=50) as pool:
        got = list(pool.map(lambda _: held(), range(50)))
    assert got == [1] * 50 and built == [os.getpid()]
    child = os.fork()
    if child == 0:  # a forked child builds its own (its parent's pool is not its to use)
        os._exit(0 if held() == 2 and built[-1] == os.getpid() else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_pool_a_worker_runs_in_is_read_from_celery() -> None:
    from celery import concurrency

    assert [pool_name(concurrency.get_implementation(n)) for n in ("prefork", "solo", "threads")] == [
        "prefork",
        "solo",
        "threads",
    ]


def test_a_job_arriving_while_its_process_is_replaced_is_counted_before_it_is_handed_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replacement waits until no job runs (``_running == 0``) and a job checks for a replacement before it runs:
    the job must count itself first, or a replacement starting between the two would see none running and end the
    process under the job."""
    from tasks import jobs
    from tasks.logs import HandedBack

    seen: list[int] = []

    class Replacing:
        def is_set(self) -> bool:
            with jobs._running_lock:
                seen.append(jobs._running)
            return True

    monkeypatch.setattr(jobs, "_replacing", Replacing())
    with pytest.raises(HandedBack):
        jobs.run_job.run("agent~r1:noop:1")
    assert seen == [1], "the job was counted running when it looked for a replacement"
    assert jobs._running == 0, "and counted out once it handed its message back"
