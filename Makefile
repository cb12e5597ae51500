# Every target creates the virtualenv it needs: `make run` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
RUN_STAMP := $(VENV)/.run-stamp
DOCS_STAMP := $(VENV)/.docs-stamp
DIST_STAMP := $(VENV)/.dist-stamp

# Install with this Python's own pip when it can target another interpreter (pip >= 22.3):
# the virtualenv is then made without pip, in well under a second instead of many.
ifeq ($(shell $(PYTHON) -c 'import pip, sys; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (22, 3))' 2>/dev/null && echo yes),yes)
VENV_ARGS := --without-pip
PIP := $(PYTHON) -m pip --python $(PY)
else
VENV_ARGS :=
PIP := $(PY) -m pip
endif
PORT ?= 5000
# pytest-xdist workers for make test: three per core, since most of the suite waits on
# servers, leases and sockets rather than computing (tests/support/parallel.py; 6 workers
# took 7 min 49 s here where 4 took 10 min 50 s). make test-fast computes more than it
# waits, and each worker collects the whole suite first: it runs on fewer.
TEST_WORKERS ?= 6
FAST_WORKERS ?= 4
HOST ?= 127.0.0.1

.PHONY: install system-deps run test test-fast test-versions lint chaos bench profile soak docs dist package-check clean

install: $(STAMP)

# The development install: the package (editable) with everything the tests need.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP) $(RUN_STAMP)

# What `make run` needs and nothing more, so a first run starts quickly: the packages
# setup.cfg lists under install_requires and the `example` extra, no test tools, and
# not the project itself (the example imports it from this checkout), so nothing is built.
$(RUN_STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PYTHON) -c 'import configparser; c = configparser.ConfigParser(); c.read("setup.cfg"); \
	  print(c["options"]["install_requires"] + c["options.extras_require"]["example"])' \
	  > $(VENV)/run-requirements.txt
	$(PIP) install --quiet --no-compile --progress-bar off -r $(VENV)/run-requirements.txt
	touch $(RUN_STAMP)

$(DOCS_STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PIP) install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

$(DIST_STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PIP) install --quiet build twine
	touch $(DIST_STAMP)

# The example payments API on the embedded default (SQLite in instance/, no Redis);
# DATABASE_URL / REDIS_URL / GATEWAY_LATENCY change that (see README).
run: $(RUN_STAMP)
	$(PY) -m example.serve --host $(HOST) --port $(PORT)

# The servers and tools the suite drives (pgbouncer, chromium, redis-tools, MariaDB): installed
# and started by tools/system-deps.sh where it may (root with apt), else named as missing.
system-deps:
	@bash tools/system-deps.sh

# mysqlclient compiles against libmariadb-dev (system-deps installs it): added when it builds;
# without it its store tests skip on a laptop and fail under CI=true.
test: system-deps install
	@$(PY) -c "import MySQLdb" 2>/dev/null || $(PIP) install --quiet 'mysqlclient >= 2.2' \
	  || echo "make test: mysqlclient did not build (apt-get install libmariadb-dev pkg-config)"
	$(PY) -m pytest -n $(TEST_WORKERS) --max-worker-restart=0 $(PYTEST_ARGS)

# The inner loop: no real server (no PostgreSQL, MariaDB or Redis server, nothing marked slow).
test-fast: install
	$(PY) -m pytest -n $(FAST_WORKERS) --max-worker-restart=0 -m "not slow and not postgres and not mysql and not redis" $(PYTEST_ARGS)

# The fault-injection suite alone: gunicorn workers SIGKILLed, Redis and PostgreSQL cut
# off behind loopback proxies (tests/chaos/); `make test` runs it too.
chaos: install
	$(PY) -m pytest -m chaos -p no:randomly -q -s $(PYTEST_ARGS)

# Supported versions, tested: the oldest set (Python 3.10, Flask 2.3.0, Werkzeug 2.3.8,
# SQLAlchemy 2.0.0, redis-py 5.0.0) and the newest (Python 3.13, latest releases), each in
# its own nox virtualenv, fast suite plus the PostgreSQL/Redis/PgBouncer smoke tests.
test-versions: install
	$(PY) -c "import nox" 2>/dev/null || $(PIP) install --quiet 'nox>=2024.3'
	$(PY) -m nox $(NOX_ARGS)

lint: install
	$(VENV)/bin/ruff check flask_idempotency tests example bench recipes docs/conf.py docs/_ext docs/check_site.py .ci/package_check.py
	$(VENV)/bin/ruff format --check flask_idempotency tests example bench recipes docs/conf.py docs/_ext docs/check_site.py .ci/package_check.py
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Latency, wake-up and throughput figures against PostgreSQL and Redis, with idemkit side by
# side: bench/results/RESULTS.md (profile: bench/profiling.py). Needs wrk for the throughput part.
# Then the Redis topologies (single node vs a 3-master cluster the script starts), the
# MariaDB paths with their raw-driver floor, and the lease heartbeat's overhead.
bench: install
	$(PY) -c "import matplotlib, idemkit, asyncpg" 2>/dev/null && test -x $(VENV)/bin/py-spy \
	  || $(PIP) install -q -e '.[bench]'
	$(PY) bench/run.py $(BENCH_ARGS)
	$(PY) bench/topologies.py --json bench/results/topologies.json
	$(PY) bench/mariadb.py | tee bench/results/mariadb.md
	$(PY) bench/heartbeat_overhead.py | tee bench/results/heartbeat.md

# Where a request's time goes, step by step (in-process timers, cProfile, py-spy on a
# gunicorn worker under wrk): bench/results/profile.md below its hand-written reading.
profile: install
	$(PY) -c "import matplotlib, idemkit, asyncpg" 2>/dev/null && test -x $(VENV)/bin/py-spy \
	  || $(PIP) install -q -e '.[bench]'
	$(PY) bench/profiling.py $(PROFILE_ARGS)

# Not in CI: 20 minutes (SOAK_ARGS="--minutes 2" for a short one) of mixed traffic under
# gunicorn while a private Redis is SIGKILLed and PostgreSQL is cut behind a proxy; counts
# executions per key, 5xx, RSS, fds and connections: bench/results/soak/, docs/soak.png.
soak: install
	$(PY) bench/soak.py $(SOAK_ARGS)

# The Sphinx site in docs/_build/html, warnings as errors; then headless Chromium takes
# screenshots of the home page and the API reference (docs/_build/screenshots/) and
# checks that every C-number cited in the code and tests has its anchor.
docs: $(DOCS_STAMP)
	rm -rf docs/_build/html
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	$(PY) docs/check_site.py docs/_build

# A wheel and an sdist in dist/, checked by twine.
dist: $(DIST_STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(VENV)/bin/twine check --strict dist/*

# Installs the built wheel (not this checkout) into a fresh virtualenv and runs the
# quick start there.
package-check: dist
	$(PYTHON) .ci/package_check.py dist

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache docs/_build
