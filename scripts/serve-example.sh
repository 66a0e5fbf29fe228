#!/usr/bin/env bash
# Install apf_gunicorn into ./.venv (created if missing) and serve the example Flask app under
# gunicorn with API Priority and Fairness on http://127.0.0.1:8000 (admin endpoint: 127.0.0.1:9180).
# Usage: bash scripts/serve-example.sh [extra gunicorn args, e.g. -w 4 --threads 32]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[example]'
exec .venv/bin/gunicorn -c python:apf_gunicorn.conf -b 127.0.0.1:8000 examples.app:app "$@"
