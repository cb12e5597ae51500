# Every target creates the virtualenv it needs: `make run` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PORT ?= 5000
HOST ?= 127.0.0.1

.PHONY: install system-deps run test test-fast lint chaos bench clean

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

# The servers and tools the suite drives (pgbouncer, chromium, redis-tools, MariaDB): installed
# and started by tools/system-deps.sh where it may (root with apt), else named as missing.
system-deps:
	@bash tools/system-deps.sh

test: install system-deps
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The fault-injection suite alone: gunicorn workers SIGKILLed, Redis and PostgreSQL cut
# off behind loopback proxies (tests/chaos/); `make test` runs it too.
chaos: install
	$(PY) -m pytest -m chaos -p no:randomly -q -s $(PYTEST_ARGS)

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
