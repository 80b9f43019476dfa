# Developer shortcuts. The README's two commands need only Python; these assume the venv they create.
PY ?= .venv/bin/python

.PHONY: install check lint types test bench bench-transitions bench-jobs bench-outbox bench-api bench-verify docs demo

install:
	python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]'

check: lint types test

lint:
	$(PY) -m ruff check agents tasks models tests bench alembic
	$(PY) -m ruff format --check agents tasks models tests bench alembic

types:
	$(PY) -m mypy

test:
	$(PY) -m pytest

bench: bench-transitions bench-jobs bench-outbox bench-api bench-verify

bench-transitions:
	$(PY) -m bench.transitions

bench-jobs:
	$(PY) -m bench.jobs

bench-outbox:
	$(PY) -m bench.outbox

bench-api:
	$(PY) -m bench.api

bench-verify:
	$(PY) -m bench.verify

docs:
	.venv/bin/keel docs phases

demo:
	.venv/bin/keel demo
