"""The job task: its Celery task id is the job key, and it only hands the key to the runner. No message is
acknowledged unless its job reached a claim, a retry or a journaled decision (invariant 12), and a revoke becomes a
journaled cancel of the job's request (docs/explanation/runtime-outbox-and-workers.md#the-job-task).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Any, NoReturn

from celery import shared_task
from celery.signals import task_revoked, worker_shutdown
from celery.utils.functional import maybe_list
from celery.worker import control as celery_control
from celery.worker import state as worker_state

from agents.core import transition as core
from agents.core.commands import Command
from agents.core.errors import KeelError, Rejected, StoreError
from agents.core.keys import request_id_of
from agents.core.outage import is_outage
from agents.core.phases import Event
from agents.jobs.handler_threads import STUCK
from agents.jobs.runner import RunOutcome
from agents.observability.logs import log_context
from agents.observability.tracing import flush_tracing
from models.jobs_sql import job_row, unpublish
from tasks.app import RUN_JOB, broker_error, publish
from tasks.logs import HandedBack
from tasks.runtime import Runtime, runtime

log = logging.getLogger("keel.tasks")

#: How long a worker waits before handing a message back while the database is away (so it does not spin).
STORE_BACKOFF_SECONDS = (1.0, 5.0)


@shared_task(name=RUN_JOB, bind=True)  # type: ignore[untyped-decorator]
def run_job(self: Any, key: str) -> str:
    """Run job ``key`` once. Duplicate deliveries are suppressed by the claim, not by Celery."""
    if self.request.id != key:
        log.warning("run_job for %s arrived with task id %s; the key is what counts", key, self.request.id)
    global _running
    # Counted before the check: a replacement that began meanwhile waits for this run (_exit_once_done), or this run
    # sees it and hands its message back; never both missed.
    with _running_lock:
        _running += 1
    try:
        if _replacing.is_set():  # this process is being replaced: the message goes back for another worker
            raise HandedBack("this worker process is being replaced", requeue=True)
        return _run_job(self, key)
    finally:
        with _running_lock:
            _running -= 1


def _run_job(self: Any, key: str) -> str:
    rt = runtime()
    try:
        with core.store_errors():  # every driver error, wherever it is raised, is a StoreError here
            outcome = rt.runner.run(key)
    except StoreError as exc:
        if not is_outage(exc):
            raise  # the database refused something: not a reason to deliver the message again
        # The claim or the outcome could not be written: hand the message back rather than ack and drop it (a job
        # that was claimed is recovered by the dispatcher once its lease expires).
        rt.outage.failed(exc)  # logs when the database goes down, not once per message handed back
        log.debug("job %s: database unavailable; message handed back to the broker", key)
        time.sleep(random.uniform(*STORE_BACKOFF_SECONDS))
        raise HandedBack(str(exc), requeue=True) from None
    rt.outage.recovered()
    try:
        request_id: str | None = request_id_of(key)
    except ValueError:
        request_id = None
    # The job's own unit of work has ended: its lines from here on name the job themselves.
    with log_context(job_key=key, request_id=request_id, agent_id=outcome.agent_id):
        return _finish(self, rt, key, outcome)


def _finish(self: Any, rt: Runtime, key: str, outcome: RunOutcome) -> str:
    """Publish what the job scheduled, and say how it ended."""
    if outcome.to_publish:
        try:
            publish(outcome.to_publish, self.app)
        except Exception as exc:
            # Committed but not published: back to pending, so the next dispatcher pass publishes them.
            cause = broker_error(exc)
            if cause is None:
                log.exception("job %s: publishing its next jobs failed; the dispatcher will publish them", key)
            else:  # Redis is away: said once per process (down, then back), not a traceback per finished step
                rt.broker.failed(cause)
                log.info("job %s: its next jobs go to the dispatcher (the broker cannot be reached)", key)
            try:
                unpublish(rt.db, [d.key for d in outcome.to_publish])
            except Exception:  # they stay enqueued: re-published after KEEL_ENQUEUE_TIMEOUT_SECONDS
                log.exception("job %s: could not hand its next jobs to the dispatcher", key)
        else:
            rt.broker.recovered()
    log.info("job %s: %s %s", key, outcome.status, outcome.detail)
    if outcome.end_process:
        end_process(key)
    return outcome.status


#: How long a worker process that ends itself (:func:`end_process`) waits for its last spans to be exported: every
#: moment it waits, the work it ends itself to stop may still act.
END_PROCESS_FLUSH_SECONDS = 0.5

#: The exit status of a worker process that asks to be replaced (``keel up`` starts it again).
EX_SOFTWARE = os.EX_SOFTWARE

_replacing = threading.Event()
#: run_job calls going on in this process, and their lock.
_running = 0
_running_lock = threading.Lock()
#: Once the last job of a process being replaced has ended, how long Celery gets to acknowledge its messages and
#: exit by itself before the process ends itself.
EXIT_GRACE_SECONDS = 5.0


def end_process(key: str) -> None:
    """Replace this worker process: job ``key`` left work running past its limit that nothing can stop, as much as
    the process may carry (KEEL_WORKER_STUCK_LIMIT; one job for prefork and solo)."""
    # Set by the worker at its start (tasks/app.py), from the pool Celery runs; unset means the default, threads.
    if os.environ.get("KEEL_WORKER_POOL", "threads") != "threads":
        log.warning("job %s: ending this worker process: work past its time limit is still running in it", key)
        _exit_now()
    rt = runtime()
    if _replacing.is_set():
        return
    _replacing.set()
    log.warning(
        "job %s: this worker process carries %d threads past their limits (KEEL_WORKER_STUCK_LIMIT): it takes no"
        " more jobs, lets its %d running ones finish (each within its run limit), and exits with status %d to be"
        " replaced",
        key,
        STUCK.count(),
        rt.runner.leases.held(),
        EX_SOFTWARE,
    )
    # Celery's warm shutdown: no more messages (those it holds go back to the broker), the running jobs finish, and
    # the worker exits with this status. Nothing is handed back mid-step: a step cut off would run (and pay) again.
    worker_state.should_stop = EX_SOFTWARE
    threading.Thread(target=_exit_once_done, name="keel-replace", daemon=True).start()


@worker_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
def _exit_to_be_replaced(sender: Any = None, **_: Any) -> None:
    """A worker that stopped to be replaced exits with :data:`EX_SOFTWARE` (``keel up`` starts it again)."""
    if _replacing.is_set() and sender is not None:
        sender.exitcode = EX_SOFTWARE


def _exit_once_done() -> NoReturn:
    """The safety net of a replacement: once no job runs here, Celery has a few seconds to exit by itself."""
    while True:
        with _running_lock:
            if _running == 0:
                break
        time.sleep(0.2)
    time.sleep(EXIT_GRACE_SECONDS)
    log.warning("exiting with status %d to be replaced (Celery had not exited by itself)", EX_SOFTWARE)
    _exit_now()


def _exit_now() -> NoReturn:
    flush_tracing(END_PROCESS_FLUSH_SECONDS)
    logging.shutdown()
    os._exit(EX_SOFTWARE)


@task_revoked.connect  # type: ignore[untyped-decorator]
def _revoked(sender: Any = None, request: Any = None, terminated: bool = False, **info: Any) -> None:
    """A delivery Celery discarded (or a process it terminated) because its task id was revoked."""
    if getattr(sender, "name", None) != RUN_JOB or request is None or info.get("expired"):
        return
    hostname = getattr(request, "hostname", None) or "worker"
    cancel_for_revoke(str(request.id), hostname=hostname, terminated=terminated, signum=info.get("signum"))


_celery_revoke = celery_control.Panel.data["revoke"]


@celery_control.control_command(name="revoke", variadic="task_id", signature="[id1 [id2 [... [idN]]]]")  # type: ignore[untyped-decorator]
def _revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None, **kwargs: Any) -> Any:
    """Celery's ``revoke`` (Flower's button, ``celery control revoke``), which first cancels the request of every
    job key it names, journaled — at once, whether the job waits, runs or is not delivered yet, by the first worker
    that hears it (the others find nothing left to cancel). Then Celery's own revoke (and terminate) follows."""
    for key in maybe_list(task_id) or []:
        cancel_for_revoke(str(key), hostname=str(state.hostname), terminated=bool(terminate), signum=signal)
    return _celery_revoke(state, task_id, terminate=terminate, signal=signal, **kwargs)


def cancel_for_revoke(key: str, *, hostname: str, terminated: bool, signum: Any = None) -> None:
    """A revoke of job ``key`` becomes a journaled cancel of its request (actor ``celery-revoke@WORKER``), never a
    silent strand: Celery would otherwise drop this and every later delivery of the key."""
    rt = runtime()
    try:
        job = job_row(rt.db, key)
        if job is None or job["status"] not in ("pending", "enqueued", "running"):
            log.info("job %s: revoked, but it is %s: nothing to cancel", key, job and job["status"])
            return
        details = {"job": key, "terminated": terminated, "signum": str(signum or "")}
        command = Command(job["agent_id"], Event.CANCEL, f"celery-revoke@{hostname}", reason="revoked", details=details)
        state = core.transition(rt.db, command)
        log.warning("job %s: revoked through Celery; its request was cancelled (agent %s)", key, state.agent.id)
    except Rejected as exc:
        log.info("job %s: revoked; its request was not cancelled: %s", key, exc)
    except KeelError:
        log.exception("job %s: revoked; recording the cancel failed (the next delivery tries again)", key)
