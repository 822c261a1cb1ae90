# `make demo` and `make test` set up .venv on first use (scripts/bootstrap).
PY := .venv/bin/python

.PHONY: bootstrap demo test lint
bootstrap:
	@scripts/bootstrap

demo: bootstrap
	$(PY) -m kvdepot.cli demo

test: bootstrap
	$(PY) -m ruff check src tests
	$(PY) -m pytest -q -rs tests

lint: bootstrap
	$(PY) -m ruff check src tests
