"""A small FastAPI app for the FastAPI instruction counts of bench_instructions.py (issue 34).

    gunicorn -k uvicorn_worker.UvicornWorker benchmarks.fastapi_items_app:app
    gunicorn -c python:apf_gunicorn.conf -k apf_gunicorn.asgi.UvicornWorker \
        benchmarks.fastapi_items_app:app

``GET /items/{item_id}`` answers a pydantic model as JSON (``{"item_id": 42, "name":
"item 42", "price": 4.2}``): routing with a path parameter, its validation and the response
model's serialization, what a typical small FastAPI endpoint does per request. ``/healthz``
answers ``ok`` (bench_server.py's probe).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

app = FastAPI()


class Item(BaseModel):
    """The response model."""

    item_id: int
    name: str
    price: float


@app.get("/items/{item_id}")
async def read_item(item_id: int) -> Item:
    """One item, made up from its id."""
    return Item(item_id=item_id, name=f"item {item_id}", price=item_id / 10)


@app.get("/healthz", response_class=PlainTextResponse)
async def healthz() -> str:
    """The probe."""
    return "ok"
