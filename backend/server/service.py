"""The model service behind the HTTP routes: request → engine inputs, and engine → answers.

One ``ModelService`` is built per app in the lifespan and kept on ``app.state.service``;
it owns the engine, the telemetry (tracer and metrics registry) and the set of engine
request ids in flight. Each generation request has a ``RequestRecord`` from ``begin`` to
``end``; it is finished (metrics observed, spans emitted) once both the handler has ended
and, if the engine ran it, the engine's final output has arrived, which for a client that
left comes through ``AsyncEngine.on_final`` after the handler is gone.

Prompts are tokenized cheaply first. One that provably exceeds the context
(``protocol.prompt_bound``: UTF-8 bytes ÷ the tokenizer's longest token) is refused with 400
context_length_exceeded before it is encoded: on the event loop from its texts alone (O(1)
per message), and again where it is tokenized, from the rendered chat template (markup
included), before encoding. A short prompt is tokenized on the event loop; a long one is
rendered and tokenized in the tokenize pool (``protocol.offload``), fair across the tenants
the gateway names in ``x-sluice-tenant`` (direct callers are one anonymous tenant), with
429/503 + Retry-After when a tenant or the pool is at its limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from backend.engine.async_engine import AsyncEngine, RequestStream
from backend.engine.errors import PromptTooLongError
from backend.engine.outputs import OutputDelta
from backend.engine.sampling import GrammarSpec, SamplingParams
from modelfiles.errors import ModelFileError
from protocol.contract import (
    SLUICE_CAPABILITIES,
    ChatRequest,
    Kind,
    check_capabilities,
    check_render_size,
    parse,
    parse_tokenize,
)
from protocol.errors import ApiError, BadRequest, ModelNotFound, RevisionMismatch, detached
from protocol.memory import Trimmer
from protocol.offload import TokenizePool
from protocol.prompt_bound import FIELD as TOKEN_BOUND_FIELD
from protocol.prompt_bound import PromptBound
from protocol.structured import NO_STRUCTURE, Structured, structured_of
from telemetry import Telemetry, extract, priority_class

from .errors import from_model_file_error
from .logprobs import LogprobFormat
from .metrics import ServerMetrics, error_type
from .sampling import sampling_params
from .tracing import NO_TENANT, RequestRecord, emit_spans

log = logging.getLogger("sluice.backend")
MAX_TENANT_LEN = 128


@dataclass(slots=True)
class Prepared:
    """A validated generation request, ready for the engine."""

    kind: Kind
    request_id: str  # engine id: the client's x-request-id, made unique while in flight
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    stream: bool
    include_usage: bool
    model: str
    fingerprint: str
    continuous_usage: bool = False  # usage on every chunk (stream_options)
    # response_format / tools: the grammar, the versions stamped, whether to read tool calls
    structured: Structured = NO_STRUCTURE
    temperature: float | None = None  # as asked (None: not given)
    top_p: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id


def header(scope: Mapping[str, Any], name: bytes) -> str | None:
    headers: Iterable[tuple[bytes, bytes]] = scope["headers"]  # ASGI
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def one_prompt(prompt: object) -> str | list[int]:
    """A completion's one prompt: a string, or token ids (a list of one of them counts)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return one_prompt(prompt[0])
        if prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        if prompt and all(isinstance(t, (str, list)) for t in prompt):
            raise BadRequest("batched prompts are not supported: send one prompt "
                             "per request", "prompt")
    raise BadRequest("prompt must be a non-empty string or list of token ids", "prompt")


def tenant_of(scope: Mapping[str, Any]) -> str:
    """The tenant the gateway names (trusted: only it holds the API key), or NO_TENANT."""
    tenant = (header(scope, b"x-sluice-tenant") or "").strip()[:MAX_TENANT_LEN]
    return tenant or NO_TENANT


class ModelService:
    def __init__(self, engine: AsyncEngine, telemetry: Telemetry | None = None,
                 tokenize_pool: TokenizePool | None = None,
                 trimmer: Trimmer | None = None) -> None:
        if engine.info is None:
            raise ValueError("the service needs an engine built from a config (engine.info)")
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.info.tokenizer
        self.versions = engine.info.versions
        self.model_name = engine.info.model_name
        self.max_model_len = engine.info.limits.max_model_len
        self.token_bound = PromptBound.of(self.tokenizer.longest_token)  # reads the vocabulary
        self.logprob_format = LogprobFormat(self.tokenizer)
        self.tokenize_pool = tokenize_pool or TokenizePool()
        self.fingerprint = self.versions.fingerprint()
        self.resolved_header = self.versions.header_value().encode("latin-1", "replace")
        self.created = int(time.time())
        self._inflight: set[str] = set()
        self._suffix = itertools.count(1)
        # Telemetry first: the metrics live in its registry (Prometheus and OTLP read it).
        self.telemetry = telemetry or Telemetry.create("sluice-backend", scope="sluice.backend")
        self.tracer = self.telemetry.tracer
        self.metrics = ServerMetrics(self.telemetry.registry)
        with contextlib.suppress(RuntimeError):  # built on its loop: the OTLP push reads there
            self.telemetry.registry.bind_loop(asyncio.get_running_loop())
        self.metrics.bind(engine.state, lambda: self.num_inflight)
        trims = (lambda: trimmer.trims) if trimmer is not None else (lambda: 0)
        self.metrics.bind_tokenize(self.tokenize_pool.snapshot, trims)
        self.clock = engine.clock  # the engine's timestamps are on this clock
        self._records: dict[str, RequestRecord] = {}  # in the engine, not finished yet
        v = self.versions.versions
        self.span_versions: dict[str, Any] = {k: val for k, val in (
            ("gen_ai.response.model", self.model_name), ("sluice.model.revision", v.revision),
            ("sluice.tokenizer", v.tokenizer), ("sluice.chat_template", v.chat_template),
            ("sluice.engine", v.engine)) if val is not None}
        engine.on_final = self._on_final

    # ---- request ids --------------------------------------------------------------------
    def claim_id(self, wanted: str | None) -> str:
        rid = wanted or uuid.uuid4().hex
        while rid in self._inflight or rid in self._records:
            rid = f"{wanted}-{next(self._suffix)}"
        self._inflight.add(rid)
        return rid

    def release_id(self, rid: str) -> None:
        self._inflight.discard(rid)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # ---- validation ---------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """Accept our name (or none); ``name@revision`` must match the served revision."""
        if model is None or model == self.model_name:
            return
        name, sep, rev = model.partition("@")
        if sep and name == self.model_name:
            served = self.versions.versions
            if served.revision_matches(rev):
                return
            raise RevisionMismatch(served.pin_refusal(name, rev))
        raise ModelNotFound(f"the model {model!r} does not exist; this server serves "
                            f"{self.model_name!r}", "model")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template's text for ``messages`` and ``tools`` (its own special tokens
        included)."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except ModelFileError as exc:
            raise from_model_file_error(exc) from exc

    def _tokenize(self, kind: Kind, value: Any, flag: bool, limit: int | None,
                  long: bool, tools: list[dict[str, Any]] | None = None) \
            -> tuple[list[int], int]:
        """(token ids, characters tokenized) of a chat's messages and tools (``flag``: add
        the generation prompt) or a completion's prompt (``flag``: add special tokens). The
        text is rendered, then bounded against ``limit`` (``PromptTooLongError`` before any
        encoding: the bound applies to exactly what would be encoded), then encoded: in a
        pool thread when ``long`` (the GIL released), else here."""
        if kind == "chat":
            check_render_size(value, tools)
            text, special = self.render(value, flag, tools), False  # the template has its bos
        else:
            prompt = one_prompt(value)
            if not isinstance(prompt, str):
                return prompt, 0  # token ids need no tokenizing
            text, special = prompt, flag
        if limit is not None and self.token_bound is not None:
            at_least = self.token_bound.over_text(text, limit)
            if at_least is not None:
                raise self.too_long(kind, at_least, at_least=True)
        encode = self.tokenizer.encode_long if long else self.tokenizer.encode
        return encode(text, add_special_tokens=special), len(text)

    async def tokenize_prompt(self, tenant: str, kind: Kind, value: Any, flag: bool = True,
                              limit: int | None = None,
                              tools: list[dict[str, Any]] | None = None) -> list[int]:
        """``_tokenize``: here when short, else in the tenant's share of the pool (429 / 503
        when that is full). ``limit``: refuse a prompt provably over it, untokenized.
        ``tools``: what the chat template renders as the tools (``Structured``)."""
        pool = self.tokenize_pool
        ids = kind == "completion" and isinstance(value, list) and bool(value) \
            and type(value[0]) is int
        if ids or not pool.is_long(value, tools):  # token ids need no pool
            return self._tokenize(kind, value, flag, limit, False, tools)[0]
        return await pool.run(tenant, functools.partial(self._tokenize, kind, value, flag,
                                                        limit, True, tools))

    def too_long(self, kind: Kind, tokens: int, at_least: bool = False) -> PromptTooLongError:
        has = f"at least {tokens}" if at_least else f"{tokens}"
        return PromptTooLongError(f"this model's maximum context length is "
                                  f"{self.max_model_len} tokens; the prompt has {has}",
                                  "messages" if kind == "chat" else "prompt")

    def check_bound(self, kind: Kind, payload: Any) -> None:
        """Refuse, untokenized, a prompt whose texts alone provably exceed the context."""
        if self.token_bound is None:
            return
        at_least = self.token_bound.over(kind, payload, self.max_model_len - 1)
        if at_least is not None:
            raise self.too_long(kind, at_least, at_least=True)

    async def prepare(self, kind: Kind, body: dict[str, Any], request_id: str | None,
                      tenant: str = NO_TENANT) -> Prepared:
        """Validate a chat or completion body; raises ApiError or engine errors.

        The field policy is the gateway's (``protocol.contract``), checked against what the
        engine serves: a field it would ignore is refused with a 400 naming it."""
        req = parse(kind, body)
        self.check_model(req.model)
        check_capabilities(req, self.model_name, SLUICE_CAPABILITIES)
        structured = NO_STRUCTURE
        payload: Any
        if isinstance(req, ChatRequest):
            structured = structured_of(req)  # 400s naming response_format, tools, ...
            payload = structured.prompt_messages(req.messages)
        else:
            payload = req.prompt
        self.check_bound(kind, payload)
        prompt_ids = await self.tokenize_prompt(tenant, kind, payload,
                                                limit=self.max_model_len - 1,
                                                tools=structured.template_tools())
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise self.too_long(kind, n)
        params = sampling_params(req, n, self.max_model_len, structured)
        if params.grammar is None:
            self.engine.validate(prompt_ids, params)
        else:  # a new grammar is compiled here (ms, up to 100s for a large schema): off the loop
            await asyncio.to_thread(self._validate_structured, prompt_ids, params, structured)
        return Prepared(
            kind=kind, request_id=request_id or "", prompt_ids=prompt_ids, params=params,
            priority=req.priority or 0, cache_salt=req.cache_salt or None,
            stream=bool(req.stream), include_usage=req.include_usage,
            continuous_usage=req.continuous_usage, structured=structured,
            model=self.model_name, fingerprint=self.fingerprint,
            temperature=None if req.temperature is None else float(req.temperature),
            top_p=None if req.top_p is None else float(req.top_p))

    def _validate_structured(self, prompt_ids: list[int], params: SamplingParams,
                             structured: Structured) -> None:
        """``engine.validate`` for a constrained request: each field's grammar alone first
        (a refusal names the field at fault), then the grammar they make together."""
        for check_kind, source, param in structured.checks:
            self.engine.validate(prompt_ids, replace(
                params, grammar=GrammarSpec(check_kind, source, param)))
        self.engine.validate(prompt_ids, params)

    # ---- generation ---------------------------------------------------------------------
    def begin(self, scope: Mapping[str, Any], kind: str) -> RequestRecord:
        """The record of a generation request, from its headers (the gateway sends the
        trusted ``x-sluice-tenant`` and the W3C ``traceparent``/``tracestate``)."""
        parent = None
        if self.telemetry.tracing:
            parent = extract(header(scope, b"traceparent"), header(scope, b"tracestate"))
        return RequestRecord(scope["state"]["request_id"], kind, tenant_of(scope),
                             self.clock(), parent)

    def reject(self, rec: RequestRecord, err: ApiError) -> None:
        """The request was refused before the engine saw it."""
        rec.error = detached(err)  # no traceback: its frames would hold the request's body
        rec.status = err.status
        self.end(rec)

    async def open(self, p: Prepared, rec: RequestRecord) -> RequestStream:
        """The engine's stream of deltas for ``p`` (``p.request_id`` claimed beforehand).

        Closing the stream, or cancelling the task reading it, aborts the request in the
        engine unless it finished. Call ``end(rec)`` when the handler is done.
        """
        stream = await self.engine.generate(p.request_id, p.prompt_ids, p.params,
                                            priority=p.priority, cache_salt=p.cache_salt)
        rec.opened = True
        self._records[p.request_id] = rec
        return stream

    def end(self, rec: RequestRecord) -> None:
        """The handler is done; finish now unless the engine's final output is still due
        (the client left: the abort's final delta reaches ``_on_final`` later). A success
        ends just before its last bytes go out, so a scrape right after sees it."""
        if rec.ended is not None:
            return
        rec.ended = self.clock()
        if rec.status == 0:
            rec.status = 499 if rec.gone else 503 if rec.shutdown else 500
        if (rec.opened and rec.delta is None and rec.error is None
                and self.engine.is_running):
            return
        self._finish(rec)

    def _on_final(self, delta: OutputDelta) -> None:
        rec = self._records.get(delta.request_id)
        if rec is None:
            return
        rec.delta = delta
        if rec.ended is not None:
            self._finish(rec)

    def _finish(self, rec: RequestRecord) -> None:
        if rec.p is not None and self._records.get(rec.p.request_id) is rec:
            del self._records[rec.p.request_id]
        ended = rec.ended if rec.ended is not None else self.clock()
        prio = priority_class(rec.p.priority) if rec.p is not None else priority_class(0)
        outcome = rec.outcome
        self.metrics.observe_request(rec.tenant, self.model_name, prio, outcome, rec.delta,
                                     rec.received, ended, kind=rec.kind,
                                     error_type=error_type(outcome, rec.error))
        if self.telemetry.tracing:
            try:
                emit_spans(self.tracer, rec, self.span_versions, self.clock)
            except Exception:
                log.exception("could not trace request %s", rec.request_id)

    def close(self) -> None:
        """Finish the records still waiting for the engine (it has stopped)."""
        for rec in list(self._records.values()):
            if rec.ended is None:
                rec.ended = self.clock()
            self._finish(rec)
        self._records.clear()

    # ---- read-only endpoints ------------------------------------------------------------
    async def tokenize(self, body: dict[str, Any], tenant: str = NO_TENANT) -> dict[str, Any]:
        req = parse_tokenize(body)
        self.check_model(req.model)
        if req.messages is not None:
            structured = structured_of(req)  # as a chat with these tools and format renders
            tokens = await self.tokenize_prompt(tenant, "chat",
                                                structured.prompt_messages(req.messages),
                                                bool(req.add_generation_prompt),
                                                tools=structured.template_tools())
        else:
            for name in ("tools", "response_format"):
                if getattr(req, name) is not None:  # nothing renders them: not ignored
                    raise BadRequest(f"'{name}' needs 'messages' (a chat renders it)", name,
                                     code="invalid_value")
            add = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = await self.tokenize_prompt(tenant, "completion", req.prompt, add)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    def models(self) -> dict[str, Any]:
        v = self.versions.versions
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "sluice", "max_model_len": self.max_model_len,
            "revision": v.revision, "tokenizer": v.tokenizer, "chat_template": v.chat_template,
            "engine": v.engine, "system_fingerprint": self.fingerprint,
            "resolved": self.versions.as_dict(),
            **({} if self.token_bound is None
               else {TOKEN_BOUND_FIELD: self.token_bound.report()}),
        }]}

    def state(self) -> dict[str, Any]:
        out = self.engine.state().as_dict()
        out["resolved"] = self.versions.as_dict()
        out["system_fingerprint"] = self.fingerprint
        out["model"] = self.model_name
        out["inflight_requests"] = self.num_inflight
        return out

