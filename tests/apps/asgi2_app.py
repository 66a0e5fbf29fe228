"""An ASGI2 (double-callable) app for the ASGI worker tests: ``app(scope)`` builds an instance,
``await instance(receive, send)`` serves it, as uvicorn serves such apps bare.

* ``/healthz`` -> 200 ``asgi2``; any other path -> 200 ``asgi2 <path>``;
* ``lifespan``: startup and shutdown completed.
"""

from __future__ import annotations


class App:
    def __init__(self, scope: dict) -> None:
        self.scope = scope

    async def __call__(self, receive, send) -> None:
        scope = self.scope
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        body = b"asgi2" if path == "/healthz" else f"asgi2 {path}".encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


app = App
