# `make demo` and `make test` set up .venv on first use (scripts/bootstrap).
PY := .venv/bin/python
# The import contracts between kvdepot's packages ([tool.importlinter] in pyproject.toml).
LINT_IMPORTS := .venv/bin/lint-imports
# Test files run on this many processes at once (pytest-xdist), a whole file on one, so
# a module's server, cluster or vLLM engine is started once; most tests wait on child
# processes, so on two cores three workers keep both busier than two (docs/design.md).
# Files go out in collection order, which tests/conftest.py makes longest first
# (pytest-xdist would otherwise send the files with the most tests first).
TEST_WORKERS ?= 3

.PHONY: bootstrap demo test lint image
bootstrap:
	@scripts/bootstrap

demo: bootstrap
	$(PY) -m kvdepot.cli demo

test: bootstrap
	$(PY) -m ruff check src tests
	$(LINT_IMPORTS)
	$(PY) -m tests.vllm_releases.releases  # the vLLM releases the scheduler-level tests run
	$(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

lint: bootstrap
	$(PY) -m ruff check src tests
	$(LINT_IMPORTS)

# The server's image (deploy/Containerfile) with a rootful Podman; tests/deploy/test_image.py
# runs it once built (docs/deploy.md, "The image").
image:
	deploy/build-image
