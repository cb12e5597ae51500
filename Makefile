# Every target creates the virtualenv it needs: `make run` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PORT ?= 5000
HOST ?= 127.0.0.1

.PHONY: install run test test-fast test-versions lint chaos bench clean

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

# The fault-injection suite alone: gunicorn workers SIGKILLed, Redis and PostgreSQL cut
# off behind loopback proxies (tests/chaos/); `make test` runs it too.
chaos: install
	$(PY) -m pytest -m chaos -p no:randomly -q -s $(PYTEST_ARGS)

# Supported versions, tested: the oldest set (Python 3.10, Flask 2.3.0, Werkzeug 2.3.0,
# SQLAlchemy 2.0.0, redis-py 5.0.0) and the newest (Python 3.13, latest releases), each in
# its own nox virtualenv, fast suite plus the PostgreSQL/Redis/PgBouncer smoke tests.
test-versions: install
	$(PY) -c "import nox" 2>/dev/null || $(PY) -m pip install --quiet 'nox>=2024.3'
	$(PY) -m nox $(NOX_ARGS)

lint: install
	$(VENV)/bin/ruff check flask_idempotency tests example bench
	$(VENV)/bin/ruff format --check flask_idempotency tests example bench
	$(VENV)/bin/mypy

# Latency, wake-up and throughput figures against PostgreSQL and Redis, with idemkit side by
# side: bench/results/RESULTS.md and latency.png. Needs wrk for the throughput part.
bench: install
	$(PY) -c "import matplotlib, idemkit, asyncpg" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
