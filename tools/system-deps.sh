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

# MariaDB: the MySQL/MariaDB store tests run against it (127.0.0.1:3306, root, empty password).
if command -v mariadb >/dev/null 2>&1 && ! mariadb -h 127.0.0.1 -u root -e 'SELECT 1' >/dev/null 2>&1; then
    if [ -x /usr/sbin/mariadbd ] && [ "$(id -u)" -eq 0 ]; then
        echo "system-deps: starting MariaDB"
        start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
        for _ in $(seq 30); do
            mariadb -h 127.0.0.1 -u root -e 'SELECT 1' >/dev/null 2>&1 && break
            sleep 1
        done
    fi
fi
if command -v mariadb >/dev/null 2>&1 && mariadb -h 127.0.0.1 -u root -e 'SELECT 1' >/dev/null 2>&1; then
    mariadb -h 127.0.0.1 -u root -e 'CREATE DATABASE IF NOT EXISTS test' >/dev/null 2>&1 || true
fi
# PostgreSQL: the suite by itself peaks at about 30 connections (the fast suite, measured:
# every test's pools are closed when it ends, tests/conftest.py), but a CI machine runs other
# suites on the same server, and the default of 100 leaves them too little headroom. Raised
# once (ALTER SYSTEM, then a restart) where this script may; a server already set is left alone.
want_connections=300
if command -v psql >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
    have=$(psql -h 127.0.0.1 -U postgres -d postgres -tAc 'SHOW max_connections' 2>/dev/null || true)
    if [ -n "$have" ] && [ "$have" -lt "$want_connections" ]; then
        echo "system-deps: PostgreSQL max_connections $have -> $want_connections (restart)"
        psql -h 127.0.0.1 -U postgres -d postgres -qc "ALTER SYSTEM SET max_connections = $want_connections" \
            && pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main restart
        for _ in $(seq 30); do
            psql -h 127.0.0.1 -U postgres -d postgres -tAc 'SELECT 1' >/dev/null 2>&1 && break
            sleep 1
        done
    fi
fi
exit 0
