"""The sidecar's request limits: the body size (before parsing), the sequences a request asks for, and the
prompt length, each refused in OpenAI's error shape with the setting that bounds it."""

from __future__ import annotations

from asyncrl.inference.asgi import Replay, TooLarge, read_body
from asyncrl.inference.errors import BadRequest, error_response

# a prompt longer than this many characters per context token cannot fit the context whatever the tokenizer:
# it is refused before it is tokenized (tokenizing a prompt of tens of megabytes takes gigabytes of memory)
CHARS_PER_TOKEN = 64


def check_size(texts: list[str], rows: int, max_rows: int, max_model_len: int) -> None:
    """Refuse a request for more than ``max_rows`` sequences (prompts x n, ``inference.max_request_rows``),
    or with a text that cannot fit a context of ``max_model_len`` tokens."""
    if rows > max_rows:
        raise BadRequest(
            f"this request asks for {rows} sequences (prompts x n); the limit is "
            f"inference.max_request_rows={max_rows}",
            param="n",
        )
    if (chars := max((len(t) for t in texts), default=0)) > max_model_len * CHARS_PER_TOKEN:
        raise BadRequest(
            f"a prompt of {chars} characters cannot fit the model's context of {max_model_len} tokens",
            param="prompt",
        )


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets a 413 in OpenAI's error shape before it is
    parsed (by its Content-Length, or once that many bytes of a chunked body have arrived)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = error_response(
            f"the request body exceeds inference.max_body_mb ({self.max_bytes} bytes)", 413
        )
        try:
            body = await read_body(scope, receive, self.max_bytes)
        except TooLarge:
            return await too_big(scope, receive, send)
        if body is None:
            return None  # the client went away
        return await self.app(scope, Replay(body, receive), send)
