#!/usr/bin/env bash
# Install apf_gunicorn with its test extra into ./.venv (created if missing) and run the tests.
# Usage: bash scripts/test.sh [pytest args...]
#   no args: two passes. 1) the whole suite (the ledger's C fast paths, when built);
#            2) with APF_NO_ACCELERATOR=1 (the pure-Python fast paths), the tests that drive
#            the ledger: TESTS_PYTHON_PATH below. Exit status 1 if either pass failed.
#   args:    one pytest run with exactly those args, as `pytest "$@"` (e.g. a test file, -k,
#            --co -q); prefix APF_NO_ACCELERATOR=1 to run them on the Python paths.
# As root with apt-get available, also installs HAProxy for tests/test_haproxy.py, wrk for
# tests/test_bench_storm.py, PostgreSQL for tests/test_signals_postgres.py and promtool
# and the prometheus server (Debian's prometheus package) for the /metrics lint, the alert
# rules and the Grafana dashboard's queries (tests/promtool.py) (each skipped, saying why,
# without it; but under CI, CI=true, a missing promtool or prometheus fails those tests); set
# APF_NO_APT=1 to skip that.
set -euo pipefail
cd "$(dirname "$0")/.."
# apt_install COMMAND PACKAGE TEST: install PACKAGE (as root, with apt-get) when COMMAND is
# missing, for the tests in TEST
apt_install() {
  if ! command -v "$1" >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && [ -z "${APF_NO_APT:-}" ] \
      && command -v apt-get >/dev/null 2>&1; then
    echo "installing $2 for $3 (apt-get; APF_NO_APT=1 skips this)" >&2
    { timeout 300 apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq "$2"; } \
      >/dev/null 2>&1 || echo "could not install $2; $3 will skip" >&2
  fi
}
apt_install haproxy haproxy tests/test_haproxy.py
apt_install wrk wrk tests/test_bench_storm.py
# PostgreSQL (initdb, pg_ctl under /usr/lib/postgresql/*/bin): the pool signals' tests start
# a throwaway server in a temp dir (tests/apps/pgserver.py)
apt_install pg_ctlcluster postgresql tests/test_signals_postgres.py
apt_install promtool prometheus "the promtool and Prometheus checks (tests/promtool.py; under CI they fail)"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi

# The second pass: every ledger test but the C-vs-Python differential ones (they need the C
# paths and would skip), the simulator (it drives the production ledger), and the real-server
# tests that take, queue, linger and repair seats across processes. The gunicorn servers they
# start inherit APF_NO_ACCELERATOR; tests/test_server_seats.py checks each worker's
# Ledger.accelerated is False then. About a minute on 2 cores.
TESTS_PYTHON_PATH=()
# (not the adaptive controller's and the lockstep's simulator tests: they drive the same ledger
# calls as the others, for their control laws)
for f in tests/test_ledger_*.py tests/test_simulate*.py; do
  case "$f" in
    tests/test_ledger_accelerator.py|tests/test_simulate_adaptive.py|tests/test_simulate_lockstep.py) ;;
    *) TESTS_PYTHON_PATH+=("$f") ;;
  esac
done
TESTS_PYTHON_PATH+=(tests/test_server_seats.py tests/test_server_seats_middleware.py
                    tests/test_server_crash.py)

status=0
echo "== pass 1 of 2: all tests (C fast paths when built) =="
.venv/bin/python -m pytest || status=1
echo "== pass 2 of 2: APF_NO_ACCELERATOR=1 (pure-Python fast paths): ${TESTS_PYTHON_PATH[*]} =="
APF_NO_ACCELERATOR=1 .venv/bin/python -m pytest "${TESTS_PYTHON_PATH[@]}" || status=1
[ "$status" = 0 ] || echo "scripts/test.sh: a pass failed (see above)" >&2
exit "$status"
