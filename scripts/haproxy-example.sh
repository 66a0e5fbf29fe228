#!/usr/bin/env bash
# Two apf_gunicorn servers (concurrency limits 6 and 3) behind a real HAProxy that weights them
# by their agent-check reports (examples/haproxy.cfg, examples/haproxy_demo.py).
# Usage:
#   bash scripts/haproxy-example.sh          # start, measure agent weights vs round robin, stop
#   bash scripts/haproxy-example.sh --serve  # start on fixed ports (HAProxy :8080/:8081, stats
#                                            # :8404/stats, agents :9201/:9202); Ctrl-C,
#                                            # SIGTERM or SIGHUP stops HAProxy and both servers
# Needs HAProxy: apt-get install haproxy (Debian/Ubuntu).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v haproxy >/dev/null 2>&1; then
  echo "haproxy is not installed; on Debian/Ubuntu: apt-get install haproxy" >&2
  exit 1
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[example]'
PYTHONPATH=. exec .venv/bin/python -m examples.haproxy_demo "$@"
