"""The bundled model server's Starlette app: routes, lifespan, error mapping.

The engine is built (or handed in) and started in the lifespan and kept on
``app.state.service``; nothing lives at module level.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backend.engine.async_engine import AsyncEngine
from backend.engine.config import EngineConfig
from backend.engine.errors import EngineError
from protocol.errors import ApiError, InternalError, ServiceUnavailable
from protocol.http import LimitedBody, error_response, exception_handlers, parse_json_object
from protocol.limits import DEFAULT_BACKEND_MAX_CONNECTIONS, ConnectionCounts, ConnectionLimits
from protocol.memory import Trimmer
from protocol.offload import OffloadSettings, TokenizePool
from telemetry import Telemetry

from .auth import ApiKeyMiddleware
from .errors import from_engine_error
from .metrics import CONTENT_TYPE
from .middleware import RESOLVED_SUFFIX, RequestContextMiddleware
from .responses import GenerationResponse
from .service import ModelService, tenant_of

log = logging.getLogger("sluice.backend")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DRAIN_RETRY_AFTER_S = 1.0  # a draining server's 503: another replica can take it now


@dataclass(slots=True, frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8001
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout_s: float = 30.0  # in-flight requests get this long after SIGTERM
    drain_grace_s: float = 0.0  # after SIGTERM, refuse with 503 this long before closing
    # slow senders cut off, open connections capped (protocol/server.py, serve.py)
    limits: ConnectionLimits = field(default_factory=lambda: ConnectionLimits(
        max_connections=DEFAULT_BACKEND_MAX_CONNECTIONS))
    log_level: str = "info"
    access_log: bool = False
    # long prompts are tokenized in this pool, fair across tenants (protocol/offload.py)
    tokenize: OffloadSettings = field(default_factory=OffloadSettings)
    # every route but /health needs "Bearer <api_key>" (backend/server/auth.py); None: open
    api_key: str | None = field(default=None, repr=False)


Handler = Callable[[Request], Awaitable[Response]]


def api(handler: Handler) -> Handler:
    """Map the errors a handler raises to OpenAI-shaped responses (bad input is never 500).
    A client gone while its body was read (``ClientDisconnect``) ends quietly: the app's
    ``exception_handlers`` answer it ``NoAnswer``."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as err:
            return error_response(err)
        except EngineError as exc:
            return error_response(from_engine_error(exc))

    wrapped.__name__ = handler.__name__
    return wrapped


def service_of(request: Request) -> ModelService:
    service: ModelService | None = getattr(request.app.state, "service", None)
    if service is None:
        raise ServiceUnavailable("the model is not loaded yet")
    return service


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, refusing more than ``limit`` bytes while reading."""
    body = LimitedBody(limit, request.headers.get("content-length"))
    async for chunk in request.stream():
        body.add(chunk)
    raw = body.body()
    request.state.body_bytes = len(raw)  # _App gives a large body's memory back after
    return parse_json_object(raw)


def _generation_route(kind: str) -> Handler:
    async def handler(request: Request) -> Response:
        service = service_of(request)
        rec = service.begin(request.scope, kind)
        try:
            if getattr(request.app.state, "draining", False):
                raise ServiceUnavailable("the server is shutting down", code="draining",
                                         retry_after_s=DRAIN_RETRY_AFTER_S)
            body = await read_json(request, request.app.state.settings.max_body_bytes)
            model = body.get("model")
            rec.requested_model = model if isinstance(model, str) else None
            prepared = await service.prepare("chat" if kind == "chat" else "completion",
                                             body, None, rec.tenant)
        except ApiError as err:
            service.reject(rec, err)
            raise
        except EngineError as exc:
            failure = from_engine_error(exc)
            service.reject(rec, failure)
            raise failure from None
        except ClientDisconnect:
            rec.gone = True
            service.end(rec)
            raise  # ends quietly: exception_handlers answers it NoAnswer
        except Exception as exc:
            service.reject(rec, InternalError(f"internal error: {type(exc).__name__}"))
            raise
        # The x-request-id the response carries (the client's, or the one made for it)
        # names the engine request too, made unique if the same id is in flight.
        prepared.request_id = rec.request_id = service.claim_id(rec.request_id)
        rec.p = prepared
        suffix = prepared.structured.header_suffix()
        if suffix:  # x-sluice-resolved names the schema and the tools this answer followed
            request.scope["state"][RESOLVED_SUFFIX] = suffix.encode("latin-1", "replace")
        return _AsResponse(GenerationResponse(service, prepared, rec))

    handler.__name__ = f"{kind}_completions"
    return api(handler)


class _App(Starlette):
    """Starlette, keeping the server's own ``send`` in ``scope["state"]["raw_send"]``.

    Streamed body chunks go straight to it (see ``GenerationResponse``): every layer
    Starlette puts around ``send`` (ServerErrorMiddleware's outermost) acts on the
    response start only, and each costs a coroutine call per token otherwise.
    Once a request with a large body has ended, its memory is given back (``Trimmer``).
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["raw_send"] = send
        await super().__call__(scope, receive, send)
        self.state.trimmer.after(state.get("body_bytes", 0))


class _AsResponse(Response):
    """Lets a handler return a raw ASGI callable where Starlette wants a Response."""

    def __init__(self, app: GenerationResponse) -> None:
        self._app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self._app(scope, receive, send)
        finally:
            self._app.service.release_id(self._app.p.request_id)


@api
async def tokenize(request: Request) -> Response:
    service = service_of(request)
    body = await read_json(request, request.app.state.settings.max_body_bytes)
    return JSONResponse(await service.tokenize(body, tenant_of(request.scope)))


@api
async def models(request: Request) -> Response:
    return JSONResponse(service_of(request).models())


@api
async def state(request: Request) -> Response:
    return JSONResponse(service_of(request).state())


@api
async def metrics(request: Request) -> Response:
    """Live state read on the loop, the text formatted on a worker thread (as the
    gateway's)."""
    text = await asyncio.to_thread(service_of(request).metrics.registry.render_later())
    return Response(text, media_type=CONTENT_TYPE)


async def health(request: Request) -> Response:
    service = getattr(request.app.state, "service", None)
    if service is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    if getattr(request.app.state, "draining", False):
        return JSONResponse({"status": "draining"}, status_code=503)
    if not service.engine.is_running:
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    return JSONResponse({"status": "ok", "model": service.model_name})


def create_app(config: EngineConfig | None = None, settings: ServerSettings | None = None,
               *, engine: AsyncEngine | None = None,
               telemetry: Telemetry | None = None,
               connections: ConnectionCounts | None = None) -> Starlette:
    """The server app. Give an already built ``engine`` (not started), or a ``config`` for
    the lifespan to build one from (off the event loop). ``telemetry`` (else one built from
    the ``OTEL_*`` environment) is the app's from then on: the lifespan shuts it down.
    ``connections``: what its listener's protocol counts (``http_protocol``), for /metrics."""
    settings = settings or ServerSettings()
    engine_config = config or EngineConfig()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tel = telemetry or Telemetry.create("sluice-backend", scope="sluice.backend")
        try:
            eng = engine
            if eng is None:
                eng = await asyncio.to_thread(AsyncEngine.from_config, engine_config)
            await eng.start()
            pool = TokenizePool(settings.tokenize)
            service = app.state.service = ModelService(eng, tel, pool, app.state.trimmer)
            if connections is not None:
                service.metrics.bind_connections(connections.snapshot)
            app.state.trimmer.start()
            try:
                yield
            finally:
                await eng.shutdown()  # aborts whatever is still running
                service.close()  # traces and metrics of requests the engine never ended
                pool.close()
                await app.state.trimmer.aclose()
                app.state.service = None
        finally:
            await asyncio.to_thread(tel.shutdown)  # flushes the last spans

    routes = [
        Route("/v1/chat/completions", _generation_route("chat"), methods=["POST"]),
        Route("/v1/completions", _generation_route("completion"), methods=["POST"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/state", state, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = _App(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=exception_handlers(log),
    )
    app.state.settings = settings
    app.state.draining = False
    app.state.service = None
    app.state.trimmer = Trimmer()
    if settings.api_key is not None:  # inside the request context: a 401 carries its id
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(RequestContextMiddleware, app_state=app.state)
    return app
