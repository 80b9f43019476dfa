"""bench.peers refuses bad arguments before it touches a server, and says how to get the peers when they are missing."""

from __future__ import annotations

import pytest

from bench import peers
from bench.peers import Run, median_run


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--jobs", "1"], "--jobs must be at least 2"),
        (["--rounds", "0"], "--rounds at least 1"),
        (["--processes", "1,two"], "--processes: expected comma-separated whole numbers, got '1,two'"),
    ],
)
def test_bad_arguments_are_refused_naming_the_option(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        peers.main(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_missing_peers_are_named_with_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(peers, "missing_peers", lambda: ["procrastinate", "dbos"])
    assert peers.main(["--jobs", "10"]) == 2
    assert "bench-peers needs procrastinate, dbos: pip install -e '.[bench]'" in capsys.readouterr().err


def test_the_median_run_takes_each_figure_on_its_own() -> None:
    runs = [Run(100, 3.0, 2.0), Run(300, 1.0, 4.0), Run(200, 2.0, 9.0)]
    assert median_run(runs) == Run(200, 2.0, 4.0)


def test_the_io_workloads_targets_are_judged_from_the_medians() -> None:
    from bench.io_peers import IoRun, targets

    table = {
        "keel": IoRun(rate=230, worker_cpu_ms=2.4, pg_cpu_ms=2.1, connections=19, rss_mb=140),
        "celery": IoRun(rate=250, worker_cpu_ms=1.7, pg_cpu_ms=0.0, connections=0, rss_mb=125),
        "procrastinate": IoRun(rate=240, worker_cpu_ms=2.1, pg_cpu_ms=1.0, connections=5, rss_mb=91),
    }
    assert targets(table) == [
        "  target: jobs/s at least 0.9x bare Celery (0.92x) -> met",
        "  target: worker CPU per job within 1.5x bare Celery's (1.41x) -> met",
        "  target: jobs/s ahead of procrastinate (0.96x) -> NOT MET",
        "  target: PostgreSQL CPU per job within 2x procrastinate's (2.10x) -> NOT MET",
    ]
