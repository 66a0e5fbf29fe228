#!/usr/bin/env bash
# Install apf_gunicorn with its test extra into ./.venv (created if missing) and run the tests.
# Usage: bash scripts/test.sh [pytest args...]
# As root with apt-get available, also installs HAProxy for tests/test_haproxy.py (skipped,
# saying why, without it); set APF_NO_APT=1 to skip that.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v haproxy >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && [ -z "${APF_NO_APT:-}" ] \
    && command -v apt-get >/dev/null 2>&1; then
  echo "installing haproxy for tests/test_haproxy.py (apt-get; APF_NO_APT=1 skips this)" >&2
  { timeout 300 apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq haproxy; } \
    >/dev/null 2>&1 || echo "could not install haproxy; tests/test_haproxy.py will skip" >&2
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
exec .venv/bin/python -m pytest "$@"
