"""Upstreams: the servers behind the public model names, and what they currently serve.

One ``Upstream`` per model entry of gateway.yaml. It owns a pooled httpx client (refreshes,
probes, /v1/tokenize), the pool's ``members`` (one per server, ``gateway.pool``) with the
router that picks among them, and the versions the model is served at: read from the
bundled backend's ``/v1/models`` (``kind: sluice``) at start and every
``refresh_interval_s``, or taken from the config for any other OpenAI-compatible server.

Each member's versions are read from that member (``Member.versions``), so a pool in the
middle of a rolling upgrade knows which server serves which revision: pins are routed by
them and every answer is stamped with the versions of the member that made it. A member that
does not answer its read has its versions forgotten (unknown: no pin goes to it) until it
answers again. ``Upstream.versions`` is the pool's face, the first member's that reports
them: what ``/v1/models`` lists and what the token counter keys on, never an answer's stamp.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx

from policies.breaker import BreakerPolicy, State
from protocol.http import digits
from protocol.offload import TokenizePool
from protocol.prompt_bound import PromptBound
from protocol.versions import RESOLVED_HEADER, ServedVersions, parse_header, short

from .config import GatewayConfig, ModelEntry, StaticVersions
from .errors import BadGateway, GatewayError, GatewayTimeout, ServiceUnavailable
from .http_client import (
    ConnectFailed,
    FirstByteTimeout,
    Pool,
    ProtocolFailed,
    ReadTimeout,
    Response,
    UpstreamHTTPError,
)
from .pool import Member, Router, build_members
from .tokens import ByteCounter, LocalCounter, TokenCounter, UpstreamCounter

log = logging.getLogger("sluice.gateway.upstream")

PROBE_TIMEOUT_S = 2.0


class UpstreamError(Exception):
    """The upstream could not be asked (unreachable) or answered nonsense."""


class Fault(Exception):
    """An attempt failed because of the server; ``err`` is what the client would get.
    ``gateway.failover`` retries a ``Fault`` on another server when it may."""

    def __init__(self, reason: str, err: GatewayError,
                 retry_after_s: float | None = None, neutral: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.err = err
        self.retry_after_s = retry_after_s
        # the server is well but could not take this request (its revision moved): retried
        # elsewhere like any fault, but its breaker is not told of a failure
        self.neutral = neutral


@dataclass(slots=True, frozen=True)
class MemberSnapshot:
    url: str
    breaker_state: State
    transitions: tuple[tuple[State, int], ...]  # (state moved to, count), sorted
    connections: int  # lent to requests now


@dataclass(slots=True, frozen=True)
class UpstreamSnapshot:
    """What the metrics read of an upstream."""

    name: str
    ready: bool
    members: tuple[MemberSnapshot, ...]


class Upstream:
    def __init__(self, entry: ModelEntry, config: GatewayConfig,
                 transport: httpx.AsyncBaseTransport | None = None,
                 tokenize_pool: TokenizePool | None = None) -> None:
        self.entry = entry
        self.name = entry.name
        self.served_name = entry.served_name
        self.capabilities = entry.capabilities
        self.media = entry.media  # what its image and audio parts cost (gateway/media.py)
        headers = {}
        if entry.api_key_env:
            key = os.environ.get(entry.api_key_env)
            if not key:
                raise ValueError(f"model {entry.name!r}: the environment variable "
                                 f"{entry.api_key_env} (its upstream key) is not set")
            headers["authorization"] = f"Bearer {key}"
        t = config.timeouts
        self.client = httpx.AsyncClient(
            base_url=entry.upstream, headers=headers, transport=transport,
            timeout=httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.read_s,
                                  pool=t.connect_s),
            limits=httpx.Limits(max_connections=entry.max_connections,
                                max_keepalive_connections=min(entry.max_connections, 256),
                                keepalive_expiry=30.0),
        )
        # The relay's hot path uses the lean pools; refreshes, probes and /v1/tokenize httpx.
        b = config.resilience.breaker
        policy = BreakerPolicy(b.consecutive_failures, b.failure_rate, b.window_s,
                               b.min_requests, b.cooldown_s, b.max_probes,
                               ramp_s=b.ramp_s, ramp_start_rps=b.ramp_start_rps)
        pools = [Pool(m.url, max_connections=entry.max_connections, connect_s=t.connect_s,
                      read_s=t.idle, first_byte_s=t.first_byte, headers=headers)
                 for m in entry.members]
        self.members: list[Member] = build_members(entry, pools, policy)
        self.router = Router(entry, self.members, config.refresh_interval_s)
        self.pool = pools[0]
        static = entry.versions or StaticVersions()
        configured = ServedVersions(static.revision, static.tokenizer, static.chat_template,
                                    static.engine)
        for m in self.members:  # a server that reports nothing serves what the config says
            if not self.reports(m):
                m.versions = configured
        self.versions: ServedVersions | None = None
        if entry.kind == "openai":
            self.versions = configured
        self.kv_tokens: int | None = entry.capacity.kv_tokens
        self.max_seqs: int | None = entry.capacity.max_seqs
        self.max_model_len: int | None = None
        # the upstream tokenizer's longest token, as its /v1/models entry reports it
        self.token_bound: PromptBound | None = None
        self.tokenize_pool = tokenize_pool
        self.last_ok: float | None = None
        self.last_error: str | None = None
        self.counter: TokenCounter = self._make_counter()

    def _make_counter(self) -> TokenCounter:
        mode = self.entry.tokenizer
        if mode == "auto":
            mode = "upstream" if self.entry.kind == "sluice" else "bytes"
        if mode == "bytes":
            return ByteCounter()
        if mode == "upstream":
            return UpstreamCounter(self.client, self.served_name, self._tokenizer_key,
                                   self._servers, lambda: self.token_bound)
        return LocalCounter(mode.removeprefix("local:"), self.tokenize_pool)

    def _servers(self) -> list[tuple[str, bool]]:
        """The pool's sluice servers, those whose breaker is closed first: (URL, whether it
        is a sluice backend)."""
        ours = [m for m in self.members if m.kind == "sluice"] or self.members
        return [(m.url, m.kind == "sluice")
                for m in sorted(ours, key=lambda m: not m.breaker.available())]

    def _tokenizer_key(self) -> str:
        v = self.versions
        return "" if v is None else f"{v.tokenizer}/{v.chat_template}"

    @property
    def ready(self) -> bool:
        return self.versions is not None

    def snapshot(self) -> UpstreamSnapshot:
        return UpstreamSnapshot(self.name, self.ready, tuple(
            MemberSnapshot(m.url, m.breaker.state, tuple(sorted(m.breaker.transitions.items())),
                           m.pool.active) for m in self.members))

    async def refresh(self) -> None:
        """Re-read what the pool serves; raises UpstreamError when no server answers."""
        results = await asyncio.gather(*(self._read(m) for m in self.members),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for r in errors:
            if not isinstance(r, UpstreamError):
                raise r
        for m, read in zip(self.members, results, strict=True):
            self._learn(m, None if isinstance(read, BaseException) else read)
        answered = [r for r in results if not isinstance(r, BaseException)]
        if not answered:
            self.last_error = str(errors[0])
            raise errors[0]
        entry = answered[0][0]
        if isinstance(entry.get("max_model_len"), int):
            self.max_model_len = entry["max_model_len"]
        if self.entry.kind == "sluice":
            ours = [m.versions for m in self.members if self.reports(m) and m.versions]
            if not ours:
                self.last_error = "no server of the pool reports its versions"
                raise UpstreamError(f"model {self.name}: {self.last_error}")
            entry = next(e for e, _ in answered if isinstance(e.get("resolved"), dict))
            self.versions = ours[0]  # a member's object: the same while it stays
            self.token_bound = PromptBound.from_report(entry)
            self._check_local_tokenizer()
        first = self.members[0]
        self.kv_tokens, self.max_seqs = first.kv_tokens, first.max_seqs
        self.last_ok = time.monotonic()
        self.last_error = None

    def _learn(self, m: Member, read: tuple[dict[str, Any], str | None] | None) -> None:
        """A sluice member's versions from its read (``None``: it did not answer, so they
        are unknown now: it may come back at another revision)."""
        if not self.reports(m):
            return  # the config's, fixed
        resolved = None if read is None else read[0].get("resolved")
        new = ServedVersions.from_report(resolved) if isinstance(resolved, dict) else None
        if new != m.versions:
            if m.versions is not None:
                log.info("model %s: upstream %s versions changed from %s to %s", self.name,
                         m.url, m.versions, new)
            m.versions = new
        reported = None if read is None else read[1]
        m.reported_header = reported if reported is not None and new is not None \
            and header_agrees(reported, new) else None

    def reports(self, m: Member) -> bool:
        """Whether the versions of ``m`` are read from it (a bundled backend of a sluice
        model), not taken from the config."""
        return self.entry.kind == "sluice" and m.kind == "sluice"

    async def _read(self, m: Member) -> tuple[dict[str, Any], str | None]:
        """One server's /v1/models entry for this model (and its capacity, if ours)."""
        try:
            resp = await self.client.get(m.url + "/v1/models", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            m.last_error = f"{type(exc).__name__}: {exc}"
            raise UpstreamError(f"{m.url} is unreachable: {m.last_error}") from exc
        if resp.status_code != 200:
            m.last_error = f"/v1/models answered {resp.status_code}"
            raise UpstreamError(f"{m.url}: {m.last_error}")
        try:
            listing = resp.json()["data"]
            entry = next((e for e in listing if e.get("id") == self.served_name), None)
        except (ValueError, KeyError, TypeError, AttributeError):
            m.last_error = "/v1/models is not an OpenAI model list"
            raise UpstreamError(f"{m.url}: {m.last_error}") from None
        if entry is None:
            m.last_error = f"it does not serve {self.served_name!r}"
            raise UpstreamError(f"{m.url}: {m.last_error}")
        if self.reports(m):
            if not isinstance(entry.get("resolved"), dict):
                m.last_error = "/v1/models reports no resolved versions (not a sluice backend?)"
                raise UpstreamError(f"{m.url}: {m.last_error}")
            await self._read_capacity(m)
        m.last_error = None
        return entry, resp.headers.get(RESOLVED_HEADER)

    async def _read_capacity(self, m: Member) -> None:
        """The bundled backend's KV capacity and batch size, from its /v1/state."""
        try:
            state = (await self.client.get(m.url + "/v1/state", timeout=PROBE_TIMEOUT_S)).json()
            m.kv_tokens = int(state["kv_blocks_total"]) * int(state["block_size"])
            m.max_seqs = int(state["max_num_seqs"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("model %s: cannot read %s/v1/state (%s); capacity unknown", self.name,
                        m.url, exc)

    def limits(self) -> tuple[int | None, int | None]:
        """(in-flight worst-case tokens, in-flight sequences) the first server's gate allows."""
        return self.members[0].limits()

    def _check_local_tokenizer(self) -> None:
        """A local tokenizer must be the one the upstream uses; if not, ask the upstream."""
        counter = self.counter
        v = self.versions
        if isinstance(counter, LocalCounter) and v is not None and (
                counter.tokenizer_sha256 != v.tokenizer
                or counter.template_sha256 != v.chat_template):
            log.warning("model %s: the local tokenizer %s differs from the upstream's; "
                        "counting tokens through the upstream instead", self.name, counter.name)
            self.counter = UpstreamCounter(self.client, self.served_name, self._tokenizer_key,
                                           self._servers, lambda: self.token_bound)

    async def probe(self) -> tuple[bool, str]:
        """Is the pool answering now? Ready while at least one server is."""
        results = await asyncio.gather(*(self._probe(m) for m in self.members))
        if len(results) == 1:
            return results[0]
        up = sum(ok for ok, _ in results)
        detail = "; ".join(f"{m.url}: {d}" for m, (_, d) in
                           zip(self.members, results, strict=True))
        return up > 0, f"{up}/{len(results)} up ({detail})"

    async def _probe(self, m: Member) -> tuple[bool, str]:
        path = "/health" if m.kind == "sluice" else "/v1/models"
        try:
            resp = await self.client.get(m.url + path, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return False, f"unreachable: {type(exc).__name__}"
        if resp.status_code != 200:
            return False, f"{path} answered {resp.status_code}"
        return True, "ok"

    async def aclose(self) -> None:
        for m in self.members:
            m.pool.close()
        await self.client.aclose()


REQUEST_FIELDS = frozenset({"schema", "tools"})  # a request's own versions, not the server's


def server_part(reported: str) -> str:
    """A server's ``x-sluice-resolved`` without the request's own fields (``schema=``,
    ``tools=``): what names the server's versions, compared with what was last read from
    it. The value itself when it has none (the common case costs two substring scans)."""
    if "schema=" not in reported and "tools=" not in reported:
        return reported
    return ";".join(part for part in reported.split(";")
                    if part.strip().partition("=")[0] not in REQUEST_FIELDS)


def header_agrees(reported: str, versions: ServedVersions) -> bool:
    """Whether a server's ``x-sluice-resolved`` names these versions: each hash it names
    (revision, tokenizer, chat template; shortened) equals theirs. A value of another shape
    agrees with nothing."""
    try:
        fields = parse_header(reported)
    except ValueError:
        return False
    ours = {"revision": short(versions.revision), "tokenizer": short(versions.tokenizer),
            "chat_template": short(versions.chat_template)}
    return all(fields.get(name, value) == value for name, value in ours.items())


UPSTREAM_RETRY_AFTER_S = 1.0  # when an unavailable upstream names no Retry-After


async def error_from(resp: Response, model: str) -> GatewayError:
    """The client-facing error for an upstream's non-200 answer (never its internals)."""
    try:
        raw = await resp.read(64 * 1024)
    except (ProtocolFailed, ReadTimeout):
        raw = b""
    status = resp.status
    message = code = param = None
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            message, code, param = err.get("message"), err.get("code"), err.get("param")
        elif isinstance(err, str):
            message = err
    except (ValueError, AttributeError):
        pass
    if status >= 500 or status in (401, 403, 404):
        # 401/403/404 from the upstream mean the gateway is misconfigured, not the client.
        log.warning("model %s: upstream answered %d: %s", model, status, message)
        if status == 503:
            retry = digits(resp.header("retry-after"))  # the upstream's: a bad one is ignored
            wait = float(retry) if retry is not None else UPSTREAM_RETRY_AFTER_S
            return ServiceUnavailable(f"the model {model!r} is unavailable right now",
                                      retry_after_s=wait)
        return BadGateway(f"the model {model!r} failed (upstream HTTP {status})")
    out = GatewayError(str(message) if message else f"the model refused the request "
                       f"(HTTP {status})", str(param) if isinstance(param, str) else None,
                       code=str(code) if code is not None else None)
    out.status = status
    out.type = "invalid_request_error"
    if status == 429:
        retry = digits(resp.header("retry-after"))
        out.retry_after_s = float(retry) if retry is not None else None
    return out


def fault_of(exc: UpstreamHTTPError, model: str, url: str, answered: bool = False) -> Fault:
    """The server's failure, as the client would hear it: each timeout its own code."""
    if isinstance(exc, ConnectFailed):
        log.warning("model %s: upstream %s unreachable: %s", model, url, exc)
        if isinstance(exc.__cause__, TimeoutError):
            return Fault("connect_timeout", GatewayTimeout(
                f"the model {model!r} did not accept a connection in time",
                code="upstream_connect_timeout"))
        return Fault("connect", ServiceUnavailable(
            f"the model {model!r} is not reachable right now",
            retry_after_s=UPSTREAM_RETRY_AFTER_S, code="upstream_unreachable"))
    if isinstance(exc, FirstByteTimeout):
        return Fault("first_byte_timeout", GatewayTimeout(
            f"the model {model!r} did not start answering in time",
            code="upstream_first_byte_timeout"))
    if isinstance(exc, ReadTimeout):
        return Fault("idle_timeout", GatewayTimeout(
            f"the model {model!r} stopped sending", code="upstream_idle_timeout"))
    log.warning("model %s: upstream %s broke %s: %s", model, url,
                "mid-answer" if answered else "before answering", exc)
    if answered:
        return Fault("disconnected", BadGateway(f"the model {model!r} broke off its answer"))
    return Fault("broken", BadGateway(f"the model {model!r} failed to answer"))
