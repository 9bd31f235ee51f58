"""What the stage tests build: a real ``Gateway`` (``build_gateway``) whose pool members
post to scripted in-memory answers instead of a network, a client ``Reply`` that records
what it was sent, and tenants. No server, no socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.client_io import Reply
from gateway.config import GatewayConfig, Listen, ModelEntry, StaticVersions
from gateway.http_client import UpstreamHTTPError
from gateway.metrics import GatewayMetrics
from gateway.service import Gateway, build_gateway
from gateway.tenants import Tenant
from gateway.tracing import NO_TRACE, NoTrace
from tests.gateway.conftest import tenants_for_tests

VERSIONS = StaticVersions(revision="r" * 40, tokenizer="t" * 64, chat_template="c" * 64,
                          engine="fake-engine/1")


@dataclass
class Scripted:
    """One upstream answer: a status, headers, and the body in chunks (bytes), or an
    ``UpstreamHTTPError`` to raise at post (``fail``) or after these chunks (``cut``)."""

    status: int = 200
    chunks: list[bytes] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    fail: UpstreamHTTPError | None = None
    cut: UpstreamHTTPError | None = None
    hold: asyncio.Event | None = None  # wait for it before the first chunk


class FakeResponse:
    def __init__(self, s: Scripted) -> None:
        self.s = s
        self.status = s.status
        self.closed = False

    def header(self, name: str) -> str | None:
        return self.s.headers.get(name)

    async def body_chunks(self) -> AsyncIterator[bytes]:
        if self.s.hold is not None:
            await self.s.hold.wait()
        for chunk in self.s.chunks:
            await asyncio.sleep(0)
            yield chunk
        if self.s.cut is not None:
            raise self.s.cut

    async def read(self, limit: int) -> bytes:
        return b"".join([c async for c in self.body_chunks()])[:limit]

    def close(self) -> None:
        self.closed = True


class FakePool:
    """A member's ``Pool``: answers each post with the next scripted answer."""

    def __init__(self, answers: list[Scripted]) -> None:
        self.answers = answers
        self.posts: list[tuple[str, bytes, list[tuple[bytes, bytes]]]] = []
        self.responses: list[FakeResponse] = []
        self.active = 0
        self.probe: Callable[[], Any] | None = None  # called at each post: state to record
        self.probed: list[Any] = []

    async def post(self, path: str, body: bytes,
                   headers: list[tuple[bytes, bytes]]) -> FakeResponse:
        self.posts.append((path, body, headers))
        if self.probe is not None:
            self.probed.append(self.probe())
        s = self.answers.pop(0)
        if s.fail is not None:
            raise s.fail
        resp = FakeResponse(s)
        self.responses.append(resp)
        return resp

    def close(self) -> None:
        pass


def sse(*events: dict[str, Any] | str, sep: bytes = b"\n\n") -> bytes:
    import json

    out = b""
    for e in events:
        data = e if isinstance(e, str) else json.dumps(e)
        out += b"data: " + data.encode() + sep
    return out


def chunk(text: str | None, *, finish: str | None = None,
          usage: dict[str, int] | None = None) -> dict[str, Any]:
    """An upstream chat chunk as vLLM writes it (the model and fingerprint, usage null)."""
    choices = [] if text is None and finish is None else [
        {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]
    return {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "fake-model",
            "system_fingerprint": "fp_up", "choices": choices, "usage": usage}


def config(*urls: str, **extra: Any) -> GatewayConfig:
    members = list(urls) or ["http://m0"]
    entry = ModelEntry(name="m", upstream=members[0] if len(members) == 1 else None,  # type: ignore[arg-type]
                       upstreams=members if len(members) > 1 else None, kind="openai",
                       tokenizer="bytes", upstream_model="fake-model", versions=VERSIONS,
                       **extra)
    return GatewayConfig(listen=Listen(port=1), models=[entry], refresh_interval_s=3600)


def gateway(cfg: GatewayConfig, answers: dict[str, list[Scripted]]) -> Gateway:
    """A real gateway whose members answer from ``answers`` (by member URL)."""
    gw = build_gateway(cfg, tenants_for_tests())
    for up in gw.upstreams.values():
        for m in up.members:
            m.pool = FakePool(answers.get(m.url, []))  # type: ignore[assignment]
    return gw


def tenant(**caps: Any) -> Tenant:
    """Tenant ``one`` with these caps."""
    return Tenant.from_entry(tenants_for_tests(**caps).tenants[0])


def quota_tenant(**quotas: Any) -> Tenant:
    """Tenant ``one`` with these quotas."""
    from gateway.config import PriorityRange, QuotasConfig, TenantEntry

    return Tenant.from_entry(TenantEntry(id="one", priority=PriorityRange(min=0, max=10,
                                                                          default=4),
                                         quotas=QuotasConfig(**quotas)))


class Client:
    """The client side of a ``Reply``: what was sent, in order."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None

    @property
    def headers(self) -> dict[bytes, bytes]:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        return dict(starts[0]["headers"]) if starts else {}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages
                        if m["type"] == "http.response.body")


def reply(client: Client, metrics: GatewayMetrics | None = None,
          trace: NoTrace = NO_TRACE) -> Reply:
    return Reply(client.send, "req-1", "/v1/chat/completions", metrics or GatewayMetrics(),
                 trace)


class Spans(NoTrace):
    """A recording trace for the stage tests: each ended phase as (name, attributes), and
    each event on the request span (auth, relay, settle) as (name, attributes)."""

    recording = True

    def __init__(self) -> None:
        self.ended: list[tuple[str, dict[str, Any]]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.attrs: dict[str, Any] = {}

    def start(self, name: str, attributes: dict[str, Any] | None = None) -> Any:
        return (name, dict(attributes or {}))

    def end(self, span: Any, **attributes: Any) -> None:
        if span is not None:
            self.ended.append((span[0], {**span[1], **attributes}))

    def event(self, name: str, **attributes: Any) -> None:
        self.events.append((name, attributes))

    def set(self, **attributes: Any) -> None:
        self.attrs.update(attributes)

    def upstream_headers(self, span: Any) -> list[tuple[bytes, bytes]]:
        return [] if span is None else [(b"traceparent", b"00-test")]

    def named(self, name: str) -> list[dict[str, Any]]:
        """The ended phase spans called ``name``, by their attributes."""
        return [attrs for n, attrs in self.ended if n == name]

    def events_named(self, name: str) -> list[dict[str, Any]]:
        """The request span's events called ``name``, by their attributes."""
        return [attrs for n, attrs in self.events if n == name]
