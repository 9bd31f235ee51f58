# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint install clean bench capacity

# torch is pinned to the version the suite passes on. From PyPI on Linux x86_64,
# torch==2.13.0 is the CUDA build (torch plus its nvidia-* wheels, several GB; it runs on a
# CPU too). The CPU-only wheel (a few hundred MB) is on the PyTorch index, not on PyPI: put
# it into .venv first and the pinned step below finds it already installed:
#   python3 -m venv .venv
#   .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
#   make install
$(STAMP): pyproject.toml
	@echo "installing into $(VENV): about 6 min on a fresh machine, most of it torch;" \
		"pip prints nothing while it works"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[1/3] upgrading pip (seconds)"
	$(PY) -m pip install -q --upgrade pip
	@echo "[2/3] torch==2.13.0 (from PyPI on Linux x86_64: the CUDA build, several GB;" \
		"minutes; seconds if $(VENV) has it already)"
	$(PY) -m pip install -q torch==2.13.0
	@echo "[3/3] sluice and its test extras: pip install -e '.[test]' (about a minute)"
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)
	@echo "installed: $(VENV)"

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
	$(PY) -m pytest -q --durations=25

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
