#!/usr/bin/env bash
# Install apf_gunicorn into ./.venv (created if missing) and start the example Flask app.
# Usage: bash scripts/serve-example.sh [extra gunicorn args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[example]'
exec .venv/bin/gunicorn -k gthread -w 2 --threads 8 -b 127.0.0.1:8000 examples.app:app "$@"
