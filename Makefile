# Every target creates the virtualenv it needs: `make run` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PORT ?= 5000
HOST ?= 127.0.0.1

.PHONY: install run test test-fast lint chaos bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The example payments API on the embedded default (SQLite in instance/, no Redis);
# DATABASE_URL / REDIS_URL / GATEWAY_LATENCY change that (see README).
run: install
	$(PY) -m example.serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check flask_idempotency tests example
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
