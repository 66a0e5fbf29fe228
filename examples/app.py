"""The example Flask app that apf_gunicorn's quick start serves.

Routes: ``/`` (hello), ``/work?ms=N`` (holds a thread N ms, to see queuing), ``/healthz`` and
``/readyz`` (probes, exempt in the built-in configuration), and ``/api/v1/namespaces/<ns>/pods``
(a Kubernetes-shaped path, so resource rules can be tried).
"""

from __future__ import annotations

import time

from flask import Flask, jsonify, request

app = Flask(__name__)


@app.get("/")
def hello():
    return "hello\n"


@app.get("/work")
def work():
    ms = min(max(request.args.get("ms", default=100, type=int), 0), 60_000)
    time.sleep(ms / 1000)
    return f"worked {ms} ms\n"


@app.get("/healthz")
@app.get("/readyz")
def probe():
    return "ok\n"


@app.get("/api/v1/namespaces/<ns>/pods")
def pods(ns: str):
    return jsonify(kind="PodList", namespace=ns, items=[])
