"""Prometheus metrics: :class:`MetricsObserver` turns each observed unit of work into one histogram observation with
bounded labels, and :func:`install_metrics` returns what a process exports, kept in memory for one process or in
prometheus_client's multiprocess mode for several behind one scrape
(docs/explanation/runtime-outbox-and-workers.md#metrics-across-processes).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Histogram,
    start_http_server,
    values,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from agents.core.observe import Op, register
from agents.core.phases import Event
from agents.observability.names import PROCESS_LOCAL

Role = Literal["api", "worker", "beat"]
ROLES: tuple[Role, ...] = ("api", "worker", "beat")
#: Where prometheus_client's multiprocess mode keeps each process's numbers (its own variable name).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: A private multiprocess directory Keel made: ``keel-{role}-metrics-{pid of its maker}-{random}`` in the temporary
#: directory.
PRIVATE_DIR = re.compile(r"keel-(?:api|worker|beat)-metrics-([0-9]{1,10})-[A-Za-z0-9_]+")
#: The value of a label whose value is unknown, malformed or one too many.
OTHER = "other"
#: Distinct values one label may take in one process; later new values count as ``other``.
LABEL_LIMIT = 50

#: Seconds. Transitions and HTTP requests are quick; job runs, model and tool calls may take minutes.
QUICK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SLOW_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
BUCKETS = {
    "transition": QUICK_BUCKETS,
    "http": QUICK_BUCKETS,
    "job": SLOW_BUCKETS,
    "model_call": SLOW_BUCKETS,
    "tool_call": SLOW_BUCKETS,
    "outbox_send": SLOW_BUCKETS,
}

_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,100}")
_ROUTE = re.compile(r"/[A-Za-z0-9_.{}/\-]{0,200}")
_STATUS = re.compile(r"[1-5][0-9][0-9]")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class BoundedLabel:
    """The values one label may take in this process: ``known`` ones if given, else any plain name (``pattern``),
    at most ``limit`` distinct ones; every other value is ``other``."""

    def __init__(
        self, *, known: frozenset[str] | None = None, pattern: re.Pattern[str] = _NAME, limit: int = LABEL_LIMIT
    ) -> None:
        self.known = known
        self.pattern = pattern
        self.limit = limit
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str | None) -> str:
        if value is None:
            return OTHER
        if self.known is not None:
            return value if value in self.known else OTHER
        if value in self.seen:
            return value
        with self._lock:  # the jobs of a threads worker label at once: the limit holds across them
            if len(self.seen) >= self.limit or not self.pattern.fullmatch(value):
                return OTHER
            self.seen.add(value)
        return value


def _labels_for(kind: str) -> tuple[BoundedLabel, ...]:
    if kind == "http":
        return BoundedLabel(known=METHODS), BoundedLabel(pattern=_ROUTE), BoundedLabel(pattern=_STATUS)
    name = BoundedLabel(known=frozenset(e.value for e in Event)) if kind == "transition" else BoundedLabel()
    return name, BoundedLabel()


class MetricsObserver:
    """Records each observed unit of work in its kind's histogram (see the module's docstring). Also a collector:
    registered on a registry, it exports the histograms (one-process mode)."""

    def __init__(self) -> None:
        # Not registered anywhere: in multiprocess mode the numbers are read back from the files, and in one process
        # the observer itself is the collector (see install_metrics).
        self.histograms = {
            kind: Histogram(m.name, m.help, m.labels, buckets=BUCKETS[kind], registry=None)
            for kind, m in PROCESS_LOCAL.items()
        }
        self.labels = {kind: _labels_for(kind) for kind in PROCESS_LOCAL}

    def label_values(self, op: Op) -> tuple[str, ...]:
        """The bounded label values ``op`` is recorded under (see :data:`agents.observability.names.PROCESS_LOCAL`)."""
        bounded = self.labels[op.kind]
        if op.kind == "http":
            method, route, status = bounded
            # "unmatched": no route took the request (a 404, or refused before routing): its path is not a label.
            raw_route = op.context.get("route")
            return (
                method(op.name),
                route(None if raw_route == "unmatched" else raw_route),
                status(op.context.get("status") or op.outcome),
            )
        name, outcome = bounded
        return name(op.name), outcome(op.outcome)

    def start(self, op: Op) -> None:
        return None

    def added(self, op: Op, context: dict[str, Any]) -> None:
        pass

    def end(self, op: Op, token: Any) -> None:
        histogram = self.histograms.get(op.kind)
        if histogram is not None:
            histogram.labels(*self.label_values(op)).observe(op.seconds or 0.0)

    def collect(self) -> Iterator[Metric]:
        for histogram in self.histograms.values():
            yield from histogram.collect()


_observer: MetricsObserver | None = None


def observer() -> MetricsObserver:
    """This process's observer, registered with :func:`agents.core.observe.register` (made on the first call)."""
    global _observer
    if _observer is None:
        _observer = MetricsObserver()
    register(_observer)
    return _observer


def multiprocess_dir() -> Path | None:
    """The multiprocess directory this process writes to, or None in one-process mode."""
    given = os.environ.get(MULTIPROC_ENV)
    return Path(given) if given else None


def prepare_multiprocess(role: Role) -> Path:
    """Switch this process and those it starts afterwards to multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` if set
    (an earlier run's ``*.db`` files deleted), else a private directory removed at exit. Call it in the parent
    before its children start; a directory serves one such family of processes only."""
    given = multiprocess_dir()
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        for stale in given.glob("*.db"):
            stale.unlink(missing_ok=True)
        path = given
    else:
        sweep_orphaned_dirs()
        path = Path(tempfile.mkdtemp(prefix=f"keel-{role}-metrics-{os.getpid()}-"))
        os.environ[MULTIPROC_ENV] = str(path)
        atexit.register(_remove_if_made_here, path, os.getpid())
    # prometheus_client picks its mode when it is imported, from the variable; this process may have imported it
    # before (a KEEL_IMPORTS module, Celery's start): switch it too, before any histogram has a value.
    if not getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    return path


def sweep_orphaned_dirs(where: Path | None = None) -> list[Path]:
    """Remove the private multiprocess directories in ``where`` (the temporary directory) left by a parent killed
    outright: only those named :data:`PRIVATE_DIR`, owned by this user, not links, whose pid is no live process.
    Returns those removed."""
    base = Path(where or tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        found = PRIVATE_DIR.fullmatch(entry.name)
        if found is None or int(found[1]) == os.getpid() or _alive(int(found[1])):
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid that names one process: leave it alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's live process (or a number no process can have: keep what we cannot judge)
    return True


def _remove_if_made_here(path: Path, owner: int) -> None:
    # Forked children inherit atexit handlers: only the process that made the directory removes it.
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def process_exited(pid: int) -> None:
    """A child process ``pid`` exited (multiprocess mode): drop what only a live process may report. Its histograms
    stay: what it observed still counts."""
    if multiprocess_dir() is not None:
        mark_process_dead(pid)  # type: ignore[no-untyped-call]


@dataclass
class Metrics:
    """What one process exports: ``registry`` (this process's or, in multiprocess mode, the sum of its family's,
    plus the collectors it was given)."""

    role: Role
    registry: CollectorRegistry
    observer: MetricsObserver

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """A scrape's body and content type (Prometheus text, or OpenMetrics when ``accept`` asks for it)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def serve(self, port: int, host: str = "127.0.0.1") -> Any:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread of this process; raises OSError if the port is
        taken. Returns the server (``.shutdown()`` stops it)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


def install_metrics(role: Role, *, collectors: Sequence[Collector] = ()) -> Metrics:
    """Record this process's units of work (the observer is registered once per process) and return what it exports:
    the process-local histograms (of the whole multiprocess family when :func:`prepare_multiprocess` was called here or
    in the parent) and ``collectors`` (e.g. the domain KPIs)."""
    if role not in ROLES:
        raise ValueError(f"unknown metrics role {role!r}; known: {', '.join(ROLES)}")
    recorder = observer()
    registry = CollectorRegistry()
    shared = multiprocess_dir()
    if shared is not None:
        MultiProcessCollector(registry, path=str(shared))  # type: ignore[no-untyped-call]
    else:
        own: tuple[Collector, ...] = (recorder, PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR)
        collectors = (*own, *collectors)
    for collector in collectors:
        registry.register(collector)
    return Metrics(role, registry, recorder)


def sample_names(registry: CollectorRegistry | Iterable[Metric]) -> set[str]:
    """The names of every series ``registry`` exports now (for checks of the dashboard and the rules)."""
    families = registry.collect() if isinstance(registry, CollectorRegistry) else registry
    return {sample.name for family in families for sample in family.samples}
