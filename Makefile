# Developer shortcuts. The README's two commands need only Python; these assume the venv they create.
PY ?= .venv/bin/python

.PHONY: install check lint types test bench bench-transitions bench-jobs bench-outbox bench-api bench-scans bench-verify bench-scale bench-peers bench-streams docs docs-serve demo

install:
	python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]'

check: lint types test

lint:
	$(PY) -m ruff check agents tasks models tests bench alembic docs/*.py
	$(PY) -m ruff format --check agents tasks models tests bench alembic docs/*.py

types:
	$(PY) -m mypy

test:
	$(PY) -m pytest

bench: bench-transitions bench-jobs bench-outbox bench-api bench-scans bench-verify

bench-transitions:
	$(PY) -m bench.transitions

bench-jobs:
	$(PY) -m bench.jobs

bench-outbox:
	$(PY) -m bench.outbox

bench-api:
	$(PY) -m bench.api

bench-scans:
	$(PY) -m bench.scans

# Not part of `make bench`: the first run seeds 1M agents' history (minutes, several GB), later runs reuse it.
bench-scale:
	$(PY) -m bench.scale

# Installs the peers (the bench extra) first: procrastinate and DBOS Transact. Prints every figure docs/benchmarks.md
# sets a target for: the no-op backlog and the burst, the I/O workload and 1,000 in flight, the producer commands;
# and the floor a job's worker CPU cannot go below (bench/floor.py).
bench-peers:
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.peers
	$(PY) -m bench.io_peers
	$(PY) -m bench.floor
	$(PY) -m bench.transitions --only-commands

bench-verify:
	$(PY) -m bench.verify

# Not part of `make bench`: holds 3,000 idle event streams open against one keel serve (a few minutes).
bench-streams:
	$(PY) -m bench.streams

# The documentation site (mkdocs.yml): docs/reference/phases.md regenerated, then the site built into site/ with
# --strict (a broken link or a page missing from the nav fails it). The Material theme's banner about MkDocs 2 is off.
docs:
	.venv/bin/keel docs phases
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The site at http://127.0.0.1:8000/, rebuilt as you edit.
docs-serve:
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

demo:
	.venv/bin/keel demo
