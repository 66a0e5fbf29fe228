"""Flask app whose requests each hold a pooled database connection (SQLAlchemy, 4 connections
per worker, no overflow), for the pool signals' server test (tests/test_signals_server.py).

``POOL_APP_DB_URL`` names the database (a SQLite file, or PostgreSQL); ``/work?ms=N`` holds a
connection N ms (``pg_sleep`` on PostgreSQL, a sleep after ``SELECT 1`` on SQLite);
``/work/patched`` says whether this worker's SQLAlchemy was patched by the discovery. Nothing
in it knows about apf_gunicorn.
"""

import os
import time

import sqlalchemy as sa
from flask import Flask, request

ENGINE = sa.create_engine(os.environ["POOL_APP_DB_URL"], pool_size=4, max_overflow=0,
                          pool_timeout=60)
app = Flask(__name__)


@app.route("/healthz")
def healthz():
    return "ok"


@app.route("/work/patched")  # (the work level: catch-all has 1 seat and rejects)
def patched():
    """Whether the pool discovery patched SQLAlchemy in this worker (``yes``/``no``)."""
    return "yes" if hasattr(sa.pool.QueuePool._do_get, "__wrapped__") else "no"


@app.route("/work")  # (the path tests/apps/apf.yaml gives a level of its own)
def db():
    seconds = float(request.args.get("ms", "50")) / 1000
    with ENGINE.connect() as conn:
        if ENGINE.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_sleep(:s)"), {"s": seconds})
        else:
            conn.execute(sa.text("SELECT 1"))
            time.sleep(seconds)
    return "ok"
