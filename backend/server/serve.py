"""Run the server under uvicorn with a graceful SIGTERM.

If the engine dies (its step loop raised, or its process exited), the open requests fail
and the server exits with status 1, for its supervisor to restart it.

On SIGTERM/SIGINT ``/health`` answers 503 "draining" and new generation requests get 503
(``code: draining``, Retry-After) at once. For ``drain_grace_s`` (default 0) the listener
stays open, so that a load balancer or a gateway sees the 503s and stops sending; then
uvicorn stops accepting, waits up to ``shutdown_timeout_s`` for in-flight requests, and
cancels the rest (each cancellation aborts its engine request); the lifespan then shuts the
engine down. A second signal skips what is left of the grace.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette

from backend.engine.async_engine import AsyncEngine
from protocol.limits import ConnectionCounts
from protocol.server import fit_file_limit, http_protocol
from telemetry import Telemetry

from .app import ServerSettings, create_app

log = logging.getLogger("sluice.backend")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Starlette,
                 on_ready: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._app = app
        self._on_ready = on_ready

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self._app.state.draining
        self._app.state.draining = True
        grace = self._app.state.settings.drain_grace_s
        if first and grace > 0:
            # keep accepting for the grace period, answering 503 + Retry-After, so that a
            # load balancer or the gateway's health checks route around us first
            timer = threading.Timer(grace, super().handle_exit, (sig, frame))
            timer.daemon = True
            timer.start()
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self._on_ready is not None:
            self._on_ready()


def serve(engine: AsyncEngine, settings: ServerSettings,
          on_ready: Callable[[], None] | None = None,
          telemetry: Telemetry | None = None) -> int:
    """Serve ``engine`` (built, not started) until SIGTERM/SIGINT; returns an exit code.
    ``telemetry`` (else one from the ``OTEL_*`` environment) is shut down on the way out."""
    connections = ConnectionCounts()  # what the protocol cuts and refuses, for /metrics
    app = create_app(settings=settings, engine=engine, telemetry=telemetry,
                     connections=connections)
    fit_file_limit(settings.limits)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # slow senders cut off, connections capped
        http=http_protocol(settings.limits, connections),
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=max(0.1, settings.shutdown_timeout_s),  # type: ignore[arg-type]  # typed int, but uvicorn hands it to asyncio.wait_for: a float works
        lifespan="on",
    )
    server = _Server(config, app, on_ready)
    died: list[bool] = []

    def engine_died() -> None:
        # Nothing can be served any more: exit (status 1) so that a supervisor (Compose's
        # restart policy, Kubernetes, systemd) starts a fresh server. The open requests
        # have already failed; uvicorn closes the listener and lets them finish.
        log.error("the engine died: the server exits with status 1 so that it is restarted")
        died.append(True)
        server.should_exit = True

    engine.on_dead = engine_died
    server.run()
    return 1 if died or not server.started else 0
