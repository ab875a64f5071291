"""The sidecar's error shape: OpenAI's ``{"error": {"message", "type", "param", "code"}}``, for every
failure.

:class:`BadRequest` is what a route raises for the caller's mistake. It is an ``HTTPException``, so under
vLLM's app (which renders those itself) it answers the same status and message; the built-in app renders it,
and every other failure (validation, unknown routes, a bug, a dead engine), in OpenAI's shape
(:func:`install_error_handlers`).
"""

from __future__ import annotations

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# the statuses the sidecar answers besides 200, as its OpenAPI schema documents them
ERRORS = {
    400: "invalid request",
    403: "not allowed",
    404: "not found",
    409: "conflict",
    413: "body too large",
}

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}


class BadRequest(HTTPException):
    """The caller's mistake: ``status`` with ``message``, and the request field it concerns (``param``)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(status, message)
        self.param = param


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown route, wrong method
    return error_response(str(exc.detail), exc.status_code)


async def _bug(_: Request, exc: Exception) -> JSONResponse:  # a bug here, not the caller's: still JSON
    return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)


# the engine is gone; the server exits soon
async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
    return error_response(str(exc), 503)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    msg = first.get("msg", "invalid request")
    return error_response(f"{loc}: {msg}" if loc else msg, 400, loc or None)


async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
    return error_response(str(exc.detail), exc.status_code, exc.param)


def install_error_handlers(app: FastAPI, unavailable: type[Exception]) -> None:
    """Answer every failure of ``app`` in OpenAI's shape; ``unavailable``: the exception a dead engine raises
    (503)."""
    app.add_exception_handler(StarletteHTTPException, _http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _bug)
    app.add_exception_handler(unavailable, _unavailable)
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(BadRequest, _bad)  # type: ignore[arg-type]
    app.openapi = lambda: app.openapi_schema or openapi_with_errors(app)  # type: ignore[method-assign]


def openapi_with_errors(app: FastAPI) -> dict:
    """FastAPI documents a 422 for every route with a body; this server answers 400 (and 403/404/409/413)
    in OpenAI's error shape instead, so the schema says that."""
    schema = FastAPI.openapi(app)
    schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for methods in schema.get("paths", {}).values():
        for op in methods.values():
            op["responses"].pop("422", None)
            for code, what in ERRORS.items():
                op["responses"].setdefault(str(code), {"description": what, **ref})
    app.openapi_schema = schema
    return schema
