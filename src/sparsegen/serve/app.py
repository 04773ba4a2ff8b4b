"""The OpenAI-compatible app: a factory over one engine, its error handlers, and the routes."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparsegen.serve.batching import Engine
from sparsegen.serve.routes import router
from sparsegen.serve.schemas import ApiError, error_body
from sparsegen.serve.server import Server


def create_app(
    engine: Engine, model_id: str, max_tokens_limit: int = 4096, context_limit: int | None = None
) -> FastAPI:
    """The ASGI app. `context_limit` caps prompt + max_tokens (set for the unbounded `full` policy)."""
    app = FastAPI(title="sparsegen", description="OpenAI-compatible server with a bounded KV cache")
    app.state.engine = engine
    app.state.server = server = Server(engine, model_id, max_tokens_limit, context_limit)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        server.answered(request, str(exc.status))
        return JSONResponse(
            error_body(exc.message, param=exc.param, code=exc.code), status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unparsable bodies, unknown routes
        server.answered(request, str(exc.status_code))
        message = f"{exc.detail}: send a UTF-8 JSON object" if exc.status_code == 400 else str(exc.detail)
        return JSONResponse(error_body(message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        location = ".".join(str(p) for p in first.get("loc", ())[1:])
        if first.get("type") == "json_invalid":
            message, location = f"the request body is not valid JSON ({first.get('msg')}); send a JSON object", ""
        else:
            message = f"{location or 'body'}: {first.get('msg')}"
        server.answered(request, "400")
        return JSONResponse(error_body(message, param=location or None), status_code=400)

    @app.exception_handler(Exception)
    async def failure(request: Request, exc: Exception):
        server.answered(request, "500")
        message = f"internal error: {type(exc).__name__}: {exc}"
        return JSONResponse(error_body(message, "server_error", code="internal_error"), status_code=500)

    app.include_router(router)
    return app
