# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint install clean bench capacity

$(STAMP): pyproject.toml setup.py telemetry/_otlp.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pin the CPU build of torch first; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/sluice up

test: $(STAMP)
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server"; \
		apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
	@command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx || { \
		echo "installing nginx (tests/deploy)"; \
		apt-get update -qq && apt-get install -y -qq nginx >/dev/null; }
	$(PY) -m pytest -q

# Checked types and lint (configured in pyproject.toml); .ci/run runs both.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m backend.bench --quick

# Gateway vs the same backend direct at 1x and 2x the swept capacity (docs/loadtest.md).
capacity: $(STAMP)
	$(PY) -m loadtest.capacity --out capacity-report

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
