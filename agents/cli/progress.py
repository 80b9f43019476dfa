"""Progress of long commands (the demo, the benchmarks): a live Rich display on a terminal, plain lines elsewhere (a
pipe, a file, CI), so logs and tests read the same text. One :class:`Progress` per command."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TextIO

from rich import progress as rich_progress
from rich.console import Console
from rich.table import Table


class Step:
    """One step in progress: :meth:`advance` it, or set what is :attr:`completed` and a short ``status``."""

    def __init__(self, owner: Progress, description: str, total: int | None, task: rich_progress.TaskID | None):
        self._owner, self.description, self.total, self._task = owner, description, total, task
        self.completed = 0
        self.status = ""

    def update(self, *, completed: int | None = None, status: str | None = None) -> None:
        if completed is not None:
            self.completed = completed
        if status is not None:
            self.status = status
        live = self._owner._live
        if live is not None and self._task is not None:
            live.update(self._task, completed=self.completed, status=self.status)

    def advance(self, n: int = 1) -> None:
        self.update(completed=self.completed + n)


class Progress:
    """A live display when ``stream`` is a terminal (or ``live=True``), plain lines otherwise."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.console = Console(file=self.stream, highlight=False, force_terminal=self.live or None)
        self._live: rich_progress.Progress | None = None

    def line(self, text: str = "") -> None:
        """A line that stays (above the live display, if any)."""
        if self.live:
            self.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    @contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Step]:
        """Show ``description`` until the block ends (a spinner, and a bar with a ``total``, on a terminal; a line at
        the start in plain mode), then one line with the time it took."""
        started = time.monotonic()
        if not self.live:
            self.line(f"{description} ...")
            step = Step(self, description, total, None)
            yield step
            self.line(f"{description}: done in {time.monotonic() - started:.1f}s")
            return
        if self._live is not None:  # a step inside a step: one more line in the same display
            live, task_id = self._live, self._live.add_task(description, total=total, status="")
            try:
                yield Step(self, description, total, task_id)
            finally:
                live.remove_task(task_id)
            self.line(f"{description}: done in {time.monotonic() - started:.1f}s")
            return
        columns: list[rich_progress.ProgressColumn | str] = [
            rich_progress.SpinnerColumn(),
            rich_progress.TextColumn("{task.description}"),
        ]
        if total is not None:
            columns += [rich_progress.BarColumn(), rich_progress.MofNCompleteColumn()]
        columns += [rich_progress.TextColumn("{task.fields[status]}"), rich_progress.TimeElapsedColumn()]
        with rich_progress.Progress(*columns, console=self.console, transient=True) as live:
            self._live = live
            step = Step(self, description, total, live.add_task(description, total=total, status=""))
            try:
                yield step
            finally:
                self._live = None
        self.line(f"{description}: done in {time.monotonic() - started:.1f}s")

    def table(self, title: str, header: Sequence[str], rows: Sequence[Sequence[object]], plain: Sequence[str]) -> None:
        """A table: Rich's on a terminal; else ``title`` and the ``plain`` lines as they are."""
        if not self.live:
            self.line(f"\n{title}")
            for text in plain:
                self.line(text)
            return
        table = Table(title=title, title_justify="left", header_style="bold")
        for n, name in enumerate(header):
            table.add_column(name, justify="right" if n and all(_numeric(r[n]) for r in rows) else "left")
        for row in rows:
            table.add_row(*(str(cell) for cell in row))
        self.console.print()
        self.console.print(table)


def _numeric(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
