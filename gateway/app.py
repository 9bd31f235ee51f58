"""The gateway's Starlette app: routes, lifespan, request ids, errors in OpenAI's shape.

The ``Gateway`` (config, keys, upstreams, ledger, metrics) is built in the lifespan and kept
on ``app.state.gateway``; ``Gateway.start`` and ``Gateway.aclose`` own its background tasks.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protocol.http import clean_request_id, error_response, exception_handlers
from protocol.large_bodies import warm as warm_parsing
from protocol.limits import ConnectionCounts
from telemetry.config import resolve as resolve_telemetry

from .admin import admin_routes
from .cache_salt import CacheSalter, salter_from_env
from .client_io import header
from .config import GatewayConfig, TenantsFile
from .endpoint import ProxyEndpoint
from .errors import GatewayError
from .metrics import CONTENT_TYPE
from .service import Gateway, build_gateway

log = logging.getLogger("sluice.gateway")

READY_CACHE_S = 1.0
_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/healthz",
                     "/readyz", "/metrics"})


class FastLane:
    """The outermost ASGI layer: ``POST`` to the two generation routes goes straight to its
    endpoint; everything else (other routes, lifespan) to Starlette. Through Starlette's
    middleware stack every SSE event would pass three ``send`` wrappers on its way out."""

    def __init__(self, app: Starlette, endpoints: dict[str, ProxyEndpoint]) -> None:
        self.app = app
        self.endpoints = endpoints
        self.state = app.state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.endpoints.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Accepts or makes ``x-request-id``, puts it on every response, counts responses."""

    def __init__(self, app: Any, app_state: Any) -> None:
        self.app = app
        self.app_state = app_state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = clean_request_id(header(scope, b"x-request-id")) or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        rid = (b"x-request-id", request_id.encode())
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), rid]
                gw: Gateway | None = getattr(self.app_state, "gateway", None)
                if gw is not None:
                    gw.metrics.observe_response(route, state.get("tenant", "-"),
                                                message["status"])
            await send(message)

        await self.app(scope, receive, send_with_id)


def gateway_of(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


async def models(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        tenant = gw.registry.authenticate(request.headers.get("authorization", "").encode()
                                         or None)
    except GatewayError as err:
        return error_response(err)
    request.scope["state"]["tenant"] = tenant.id
    data = []
    for up in gw.upstreams.values():
        if not tenant.may_use(up.name):
            continue
        item: dict[str, Any] = {"id": up.name, "object": "model", "created": gw.created,
                                "owned_by": "sluice"}
        v = up.versions
        if v is not None:
            item.update(revision=v.revision, tokenizer=v.tokenizer,
                        chat_template=v.chat_template, engine=v.engine)
        if up.max_model_len is not None:
            item["max_model_len"] = up.max_model_len
        data.append(item)
    return JSONResponse({"object": "list", "data": data})


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Ready when every upstream answers now (probed at most once a second)."""
    gw = gateway_of(request)
    state = request.app.state
    now = time.monotonic()
    cached = getattr(state, "ready_cache", None)
    if cached is None or now - cached[0] > READY_CACHE_S:
        names = list(gw.upstreams)
        results = await asyncio.gather(*(gw.upstreams[n].probe() for n in names))
        checks = {n: {"ok": ok, "detail": detail} for n, (ok, detail) in
                  zip(names, results, strict=True)}
        checks["store"] = await _store_check(gw)
        cached = (now, checks)
        state.ready_cache = cached
    checks = cached[1]
    ready = all(c["ok"] for c in checks.values()) and not state.draining
    return JSONResponse({"status": "ready" if ready else "not_ready", "checks": checks},
                        status_code=200 if ready else 503)


async def _store_check(gw: Gateway) -> dict[str, Any]:
    from policies.store import StoreUnavailable

    adm = gw.admission
    try:
        await adm.store.ping()
    except StoreUnavailable as exc:
        return {"ok": False, "detail": f"{type(adm.store).__name__}: {exc}"}
    return {"ok": True, "detail": type(adm.store).__name__}


async def metrics(request: Request) -> Response:
    """Live state read on the loop; the text formatted on a worker thread (a large scrape
    takes a while and must not hold the loop)."""
    gw = gateway_of(request)
    text = await asyncio.to_thread(gw.metrics.registry.render_later())
    return Response(text, media_type=CONTENT_TYPE)


def create_app(config: GatewayConfig, tenants: TenantsFile, *,
               transport: httpx.AsyncBaseTransport | None = None,
               salter: CacheSalter | None = None,
               connections: ConnectionCounts | None = None, warm: bool = False) -> FastLane:
    """The gateway app (``.state.gateway`` once started); ``transport`` replaces httpx's
    network for tests; ``salter`` (else one from ``$SLUICE_CACHE_SALT_KEY``) derives the
    tenants' cache_salt; ``connections`` is what its listener's protocol counts
    (``protocol.server.http_protocol``), shown in /metrics; ``warm`` starts the parse
    pool's worker process at start-up rather than at the first large body. Raises ``TelemetryError`` (a ValueError) for bad OTEL_* settings
    and ``ConfigError`` for a missing or short cache-salt key now, not at the first
    request."""
    resolve_telemetry(config.telemetry, "sluice-gateway", os.environ)
    salter = salter or salter_from_env(config, os.environ)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gw = build_gateway(config, tenants, transport, salter=salter)
        if connections is not None:
            gw.metrics.bind_connections(connections.snapshot)
        await gw.start()
        if warm:
            warm_parsing(gw.parse_pool)
        app.state.gateway = gw
        # Everything built so far lives as long as the process: keep it out of the cyclic
        # collector's full passes, whose cost grows with the heap (a full pass over the
        # startup heap paused the loop for tens of ms under load, p99 added).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await gw.aclose()

    from starlette.datastructures import State

    state = State()
    chat = ProxyEndpoint("chat", "/v1/chat/completions", state)
    completion = ProxyEndpoint("completion", "/v1/completions", state)
    routes = [
        # POSTs never get here (FastLane takes them); these answer other methods with 405
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *admin_routes(),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers=exception_handlers(log))
    app.state = state
    app.state.draining = False
    app.state.gateway = None
    app.add_middleware(RequestIdMiddleware, app_state=app.state)
    return FastLane(app, {"/v1/chat/completions": chat, "/v1/completions": completion})
