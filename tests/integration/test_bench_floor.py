"""bench.floor (the least a job's two transactions cost the worker) runs its statements for real: every job is
claimed and finished exactly once, and bad arguments are refused naming the option."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from bench import floor
from models.urls import libpq_url


def test_the_floor_claims_and_finishes_every_job_once(empty_db_url: str) -> None:
    url = libpq_url(empty_db_url)
    cpu_ms, wall_ms = floor.measure(url, jobs=60, threads=3)
    assert cpu_ms > 0 and wall_ms > 0
    with psycopg.connect(url) as conn:
        counted = "SELECT status, count(*), count(DISTINCT token) FROM f_jobs GROUP BY 1"
        rows: list[Any] = conn.execute(counted).fetchall()
        revisions = conn.execute("SELECT min(revision), max(revision) FROM f_agents").fetchone()
    assert rows == [("succeeded", 60, 60)]
    assert revisions == (1, 1)


@pytest.mark.parametrize("argv", [["--jobs", "0"], ["--threads", "0"], ["--rounds", "0"]])
def test_bad_arguments_are_refused_naming_the_options(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        floor.main(argv)
    assert exited.value.code == 2
    assert "--jobs, --threads and --rounds must be at least 1" in capsys.readouterr().err
