"""ASGI plumbing the sidecar's middleware shares: reading a request's body within a bound, handing it on
again, and sending a request to another path of the same app."""

from __future__ import annotations

from typing import Any


class TooLarge(Exception):
    """A request body over the bound."""


class Replay:
    """An ASGI ``receive`` that hands the app the body read already, in one message, then the real
    ``receive``."""

    def __init__(self, body: bytes, receive: Any):
        self.body, self.receive, self.replayed = body, receive, False

    async def __call__(self) -> Any:
        if self.replayed:
            return await self.receive()
        self.replayed = True
        return {"type": "http.request", "body": self.body, "more_body": False}


async def read_body(scope: dict[str, Any], receive: Any, max_bytes: int) -> bytes | None:
    """The request's whole body, ``None`` if the client went away first; :class:`TooLarge` past ``max_bytes``
    (by its Content-Length, or once that many bytes of a chunked body have arrived)."""
    length = dict(scope.get("headers") or []).get(b"content-length")
    if length is not None and (not length.isdigit() or int(length) > max_bytes):
        raise TooLarge
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > max_bytes:
            raise TooLarge
        if not message.get("more_body"):
            return b"".join(chunks)


def at_path(scope: dict[str, Any], path: str, body: bytes | None = None) -> dict[str, Any]:
    """``scope`` sent to ``path`` of the same app, with the Content-Length of ``body`` when it is given."""
    headers = scope.get("headers") or []
    if body is not None:
        headers = [(k, v) for k, v in headers if k != b"content-length"] + [
            (b"content-length", b"%d" % len(body))
        ]
    return {**scope, "path": path, "raw_path": path.encode(), "headers": headers}
