"""`make bench-scale`: its arguments are checked before anything is seeded, and the history it seeds is one Keel's
own verify accepts (the same walk `keel audit verify` makes, under the bench's key)."""

from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Any

import pytest

from agents.cli.progress import Progress
from agents.core import journal
from bench import scale, seed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--agents", "1500"], "--agents must be a multiple of 1000, got 1500"),
        (["--agents", "999"], "999 is below the minimum, 1000"),
        (["--agents", "many"], "'many' is not a whole number"),
        (["--samples", "2"], "2 is below the minimum, 5"),
        (["--live", "0"], "0 is below the minimum, 10"),
        (["--drop-everything"], "unrecognized arguments: --drop-everything"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        scale.parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_are_the_issue_s_sizes() -> None:
    args = scale.parse_args([])
    assert (args.agents, args.reseed) == (1_000_000, False)
    assert scale.parse_args(["--agents", "1_000_000"]).agents == 1_000_000
    assert [scale.database_name(n) for n in (1_000_000, 1000, 2500)] == [
        "keel_bench_scale_1m",
        "keel_bench_scale_1k",
        "keel_bench_scale_2500",
    ]


def test_only_the_bench_s_own_databases_are_ever_dropped() -> None:
    with pytest.raises(ValueError, match="not a bench-scale database"):
        scale._drop(None, "keel")  # type: ignore[arg-type]  # refused before any connection is used


def test_the_marker_records_version_sizes_and_key() -> None:
    assert seed.Sizes(1000).marker() == (
        f"keel bench-scale seed v{seed.SEED_VERSION}: agents=1000 jobs=10000 outbox=1000 delivery_log=1000"
        " journal=12000 key=bench-scale-1"
    )


def _rows(k: int) -> tuple[list[dict[str, Any]], str]:
    rows, head = seed._history(k, datetime(2026, 12, 1, 12, 0, 0, 123456, tzinfo=UTC), 1)
    columns = [c.strip() for c in seed._JOURNAL_COLUMNS.split(",")]
    as_read = []
    for row in rows:
        named = dict(zip(columns, row, strict=True))
        named["details_json"] = named.pop("details")
        as_read.append(named)
    return as_read, head


def _walk(k: int, rows: list[dict[str, Any]], head: str) -> journal.ChainBreak | None:
    walk = journal.ChainWalk(seed.agent_id(k), seed.BENCH_KEYS, None)
    for row in rows:
        broken = walk.step(row)
        if broken is not None:
            return broken
    last = rows[-1]
    return walk.end(
        journal.ChainHead(seed.agent_id(k), last["seq"], head, last["revision"], "done", seed.request_id(k), False)
    )


def test_a_seeded_chain_verifies_under_the_bench_key() -> None:
    rows, head = _rows(41)
    assert len(rows) == seed.EVENTS_PER_AGENT
    assert [r["revision"] for r in rows] == list(range(seed.JOBS_PER_AGENT + 2))
    assert (rows[1]["event"], rows[-1]["event"], rows[-1]["to_phase"]) == ("submit", "finish", "done")
    assert _walk(41, rows, head) is None


def test_a_changed_seeded_event_is_caught() -> None:
    rows, head = _rows(41)
    rows[5]["details_json"] = rows[5]["details_json"].replace('"attempt":1', '"attempt":2')
    broken = _walk(41, rows, head)
    assert broken is not None and broken.seq == 6 and "HMAC" in broken.reason


def test_the_ratio_interval_tells_growth_from_one_slow_tail() -> None:
    ms = [0.001 + k * 0.00001 for k in range(40)]  # 1.00-1.39 ms
    same = scale.ratio_interval(ms, list(reversed(ms)))
    assert same[0] <= 1.0 <= same[1]
    doubled = scale.ratio_interval(ms, [2 * x for x in ms])
    assert scale.TARGET < doubled[0] <= 2.0 <= doubled[1] < 2.2
    tail = [*ms[:38], 0.005, 0.005]  # two slow samples of 40: the p95 alone says 3.6x
    assert scale.pct(tail, 95) / scale.pct(ms, 95) > 3
    low, high = scale.ratio_interval(ms, tail)
    assert low <= scale.TARGET < high
    assert scale.ratio_interval(ms, tail) == (low, high)  # seeded: the same samples give the same interval
    with pytest.raises(ValueError, match="samples on both sides"):
        scale.ratio_interval([], ms)


NAMES = ("flat", "doubled", "one slow tail")


def test_the_report_says_which_misses_grew(monkeypatch: pytest.MonkeyPatch) -> None:
    printed = io.StringIO()
    monkeypatch.setattr(scale, "OUT", Progress(printed, live=False))
    ms = [0.001 + k * 0.00001 for k in range(40)]
    scale.report(
        {
            "flat": {"1k": ms, "1m": ms},
            "doubled": {"1k": ms, "1m": [2 * x for x in ms]},
            "one slow tail": {"1k": ms, "1m": [*ms[:38], 0.005, 0.005]},
        },
        "1k",
        "1m",
    )
    out = printed.getvalue()
    lines = {name: next(line for line in out.splitlines() if line.startswith(f"{name}  ")) for name in NAMES}
    assert lines["flat"].endswith(" met")
    assert lines["doubled"].endswith("NOT MET (grew)")
    assert lines["one slow tail"].endswith("NOT MET (within its interval)")
    assert "1 of 3 measures within 1.2x" in out
    assert "1 of 3 with the whole 90% interval of the ratio above 1.2x" in out
