"""The ASGI front end: APF for FastAPI, Starlette and other ASGI apps under gunicorn.

    gunicorn -c python:apf_gunicorn.conf -k apf_gunicorn.asgi.UvicornWorker app:app
    gunicorn -c python:apf_gunicorn.conf -k apf_gunicorn.asgi.ASGIWorker app:app

The worker classes load lazily (``UvicornWorker`` needs ``pip install 'apf_gunicorn[asgi]'``),
so importing this package costs nothing for WSGI servers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ASGIWorker", "UvicornWorker"]


def __getattr__(name: str) -> Any:
    if name == "ASGIWorker":
        from apf_gunicorn.asgi.workers import ASGIWorker

        return ASGIWorker
    if name == "UvicornWorker":
        from apf_gunicorn.asgi.workers import UvicornWorker

        if UvicornWorker is None:
            raise ImportError("apf_gunicorn.asgi.UvicornWorker needs uvicorn-worker: "
                              "pip install 'apf_gunicorn[asgi]'")
        return UvicornWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
