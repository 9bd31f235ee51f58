"""Prompt token counts, exact where the model's own tokenizer is reachable.

Three counters, chosen per model by ``tokenizer:`` in gateway.yaml:

* ``LocalCounter``: the model's tokenizer and chat template loaded in the gateway from the
  model directory (the same code the bundled backend uses). Exact.
* ``UpstreamCounter``: the upstream's ``POST /v1/tokenize`` (the bundled backend, vLLM).
  Exact; costs one round trip, so counts are cached per (tokenizer, template, input).
* ``ByteCounter``: for an upstream with neither, a documented conservative upper bound: the
  UTF-8 byte length of the JSON-encoded input plus 16. Each token of a byte-level BPE covers at
  least one byte, and the JSON quoting, keys and braces around each message outweigh the few
  special tokens a chat template adds. Settlement corrects it from the usage the upstream
  reports.

A chat is counted as its upstream renders it (``structured.ChatExtras``): with its tools
(by the chat template) and, for the bundled backend, the instruction that carries a
``response_format``'s schema in the system message. ``LocalCounter`` renders them itself,
``UpstreamCounter`` sends ``tools`` and ``response_format`` to ``/v1/tokenize`` (the
latter to a Sluice backend only: another server does not put a schema in the prompt), and
``ByteCounter`` adds their JSON bytes to its bound.

Cheap checks first. Given a ``limit`` (the most prompt tokens the request may have: the
tenant's cap, the context), the two exact counters apply the lower bound of
``protocol.prompt_bound`` (UTF-8 bytes ÷ the tokenizer's longest token: from ``modelfiles``
for a local tokenizer, from the upstream's ``/v1/models`` entry otherwise) and raise
``OverLimit`` when it exceeds the limit. On the event loop, to the request's texts alone:
O(1) per message (the contract caps their number), no tokenizing, nothing posted. A local
tokenizer applies it again in its worker, to the rendered prompt (template markup and tools
included), before encoding it. A long prompt is rendered and tokenized in the gateway's
``protocol.offload.TokenizePool`` (threads, fair across tenants, 429/503 when full); a short
one on the event loop, where a thread hop would cost more than the work.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import httpx

from modelfiles.errors import ModelFileError
from protocol.contract import check_render_size
from protocol.errors import RateLimited
from protocol.http import retry_after_s
from protocol.offload import TokenizePool
from protocol.prompt_bound import PromptBound

from .errors import BadGateway, BadRequest, GatewayError, ServiceUnavailable
from .structured import NO_EXTRAS, ChatExtras

BYTE_BOUND_OVERHEAD = 16
_CACHE_SIZE = 4096
_MAX_RETRY_DIGITS = 9  # an upstream's Retry-After: up to ~11 days (ms), else ignored


class OverLimit(Exception):
    """The prompt provably has more tokens than the limit asked about; it was not
    encoded. ``at_least`` is the lower bound that shows it."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


class TokenCounter(Protocol):
    exact: bool
    name: str

    async def count(self, kind: str, payload: Any, extras: ChatExtras = NO_EXTRAS, *,
                    tenant: str = "", limit: int | None = None) -> int:
        """Prompt tokens of a chat (``payload`` = messages, rendered with ``extras``) or
        completion (the prompt); raises ``OverLimit`` when it provably has more than
        ``limit``, before any tokenizing. ``tenant`` is whose work it is (the tokenizing
        pool's fairness)."""
        ...


def check_bound(bound: PromptBound | None, kind: str, payload: Any, limit: int | None) -> None:
    """Raise ``OverLimit`` if the request's texts alone provably exceed ``limit`` tokens."""
    if bound is not None and limit is not None:
        at_least = bound.over(kind, payload, limit)
        if at_least is not None:
            raise OverLimit(at_least)


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                      sort_keys=True).encode()


def _token_ids(prompt: Any) -> list[int] | None:
    """A completion prompt given as token ids (one list) counts itself."""
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        return _token_ids(prompt[0])
    return None


class _Lru:
    def __init__(self, size: int = _CACHE_SIZE) -> None:
        self._data: OrderedDict[bytes, int] = OrderedDict()
        self._size = size

    def get(self, key: bytes) -> int | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: bytes, value: int) -> None:
        self._data[key] = value
        if len(self._data) > self._size:
            self._data.popitem(last=False)


class ByteCounter:
    exact = False
    name = "bytes"

    async def count(self, kind: str, payload: Any, extras: ChatExtras = NO_EXTRAS, *,
                    tenant: str = "", limit: int | None = None) -> int:
        ids = _token_ids(payload) if kind == "completion" else None
        if ids is not None:
            return len(ids)
        n = len(_json_bytes(payload)) + BYTE_BOUND_OVERHEAD
        tools = extras.tools
        if tools:
            n += len(_json_bytes(tools))
        # the schema's instruction as a message of its own (what the bundled backend adds to
        # the system message, and more); for another server the response_format's JSON
        # (one that puts the schema in the prompt, as OpenAI does, takes no more)
        instruction = extras.structured.instruction
        if instruction is not None:
            n += len(_json_bytes({"role": "system", "content": instruction}))
        elif extras.response_format is not None:
            n += len(_json_bytes(extras.response_format))
        return n


class LocalCounter:
    """The model's tokenizer, loaded in-process (no torch: tokenizers + jinja2 only)."""

    exact = True

    def __init__(self, model_dir: str | Path, pool: TokenizePool | None = None) -> None:
        from modelfiles.tokenizer import Tokenizer

        if str(model_dir) == "tiny":
            from modelfiles.tiny_model import ensure_tiny_model

            model_dir = ensure_tiny_model()
        try:
            self.tokenizer = Tokenizer.from_dir(model_dir)
        except (ModelFileError, OSError) as exc:
            raise ValueError(f"cannot load the tokenizer from {model_dir}: {exc}") from exc
        self.name = f"local:{model_dir}"
        self.tokenizer_sha256 = self.tokenizer.sha256
        self.template_sha256 = self.tokenizer.chat_template_sha256
        self.bound = PromptBound.of(self.tokenizer.longest_token)  # reads the vocabulary
        self.pool = pool or TokenizePool()

    def _count(self, kind: str, payload: Any, extras: ChatExtras,
               limit: int | None) -> tuple[int, int]:
        """(tokens, characters tokenized): in a pool thread for a long prompt, on the loop
        for a short one. Rendered, then bounded (``OverLimit``, before any encoding), then
        counted (``Tokenizer.count``: no list of ids built, and the GIL released)."""
        tok = self.tokenizer
        try:
            if kind == "chat":
                tools = extras.tools
                # + the schema's text, tool calls' arguments parsed: checked as rendered
                messages = extras.structured.prompt_messages(payload)
                check_render_size(messages, tools)
                text = tok.apply_chat_template(messages, add_generation_prompt=True,
                                               tools=tools)
                special = False  # the rendered template carries its own (bos)
            else:
                if isinstance(payload, list) and len(payload) == 1:
                    payload = payload[0]
                if not isinstance(payload, str):
                    raise BadRequest("prompt must be a string or a list of token ids", "prompt")
                text, special = payload, True
        except ModelFileError as exc:
            raise BadRequest(f"cannot render the prompt: {exc}",
                             "messages" if kind == "chat" else "prompt") from None
        if self.bound is not None and limit is not None:
            at_least = self.bound.over_text(text, limit)
            if at_least is not None:
                raise OverLimit(at_least)
        return tok.count(text, add_special_tokens=special), len(text)

    async def count(self, kind: str, payload: Any, extras: ChatExtras = NO_EXTRAS, *,
                    tenant: str = "", limit: int | None = None) -> int:
        if kind == "completion":
            ids = _token_ids(payload)
            if ids is not None:
                return len(ids)
        check_bound(self.bound, kind, payload, limit)
        s = extras.structured
        if not self.pool.is_long(payload, s.tools, s.instruction):
            return self._count(kind, payload, extras, limit)[0]
        return await self.pool.run(tenant, functools.partial(self._count, kind, payload,
                                                             extras, limit))


class UpstreamCounter:
    """``POST /v1/tokenize`` on the upstream, cached per tokenizer and template version."""

    exact = True
    name = "upstream"

    def __init__(self, client: httpx.AsyncClient, model: str, version_key: Any,
                 servers: Callable[[], list[tuple[str, bool]]] | None = None,
                 bound: Callable[[], PromptBound | None] = lambda: None) -> None:
        self._client = client
        self._bound = bound  # what the upstream last reported (``Upstream.refresh``)
        # a pool's (base URL, is a sluice backend), healthiest first: tried in turn; only a
        # sluice backend is told the tenant (its pool's fairness), as the relay does
        self._servers = servers
        self._model = model
        self._version_key = version_key  # callable -> str naming tokenizer + template
        self._cache = _Lru()

    async def count(self, kind: str, payload: Any, extras: ChatExtras = NO_EXTRAS, *,
                    tenant: str = "", limit: int | None = None) -> int:
        if kind == "completion":
            ids = _token_ids(payload)
            if ids is not None:
                return len(ids)
            if isinstance(payload, list) and len(payload) == 1:
                payload = payload[0]
        check_bound(self._bound(), kind, payload, limit)
        servers = self._servers() if self._servers is not None else [("", False)]
        fields: dict[str, Any] = {"model": self._model}
        if kind == "chat":  # what the upstream would refuse: before serializing it here
            tools = extras.tools
            check_render_size(payload, tools)
            fields["messages"] = payload
            if tools:
                fields["tools"] = tools
            # a Sluice backend puts the schema in the prompt; another server does not (and
            # its /v1/tokenize may not take the field)
            if extras.response_format is not None and servers[0][1]:
                fields["response_format"] = extras.response_format
        else:
            fields["prompt"] = payload
        # serialized once, on the loop (json.dumps holds the GIL anywhere): the key and the
        # post; the key holds everything the count depends on (tools, format included)
        body = _json_bytes(fields)
        key = hashlib.blake2b(str(self._version_key()).encode() + b"\0" + body,
                              digest_size=16).digest()
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        resp = await self._post(body, tenant, servers)
        if resp.status_code == 400:
            message = _error_message(resp) or "the upstream refused the prompt"
            named = _error_field(resp)  # the field it names, when it is one that was sent
            raise BadRequest(message, named if named in fields and named != "model"
                             else "messages" if kind == "chat" else "prompt")
        if resp.status_code in (429, 503):  # its tokenizing pool is busy (for this tenant)
            err: GatewayError = (RateLimited if resp.status_code == 429 else ServiceUnavailable)(
                _error_message(resp) or "the upstream cannot count tokens right now",
                retry_after_s=_retry_after(resp))
            raise err
        if resp.status_code != 200:
            raise BadGateway(f"the upstream's /v1/tokenize answered {resp.status_code}")
        try:
            count = int(resp.json()["count"])
        except (ValueError, KeyError, TypeError):
            raise BadGateway("the upstream's /v1/tokenize answer has no count") from None
        self._cache.put(key, count)
        return count


    async def _post(self, body: bytes, tenant: str,
                    servers: list[tuple[str, bool]]) -> httpx.Response:
        for i, (base, sluice) in enumerate(servers):
            headers = {"content-type": "application/json"}
            if tenant and sluice:
                headers["x-sluice-tenant"] = tenant
            try:
                return await self._client.post(base + "/v1/tokenize", content=body,
                                               headers=headers)
            except httpx.TransportError as exc:
                if i == len(servers) - 1:
                    raise ServiceUnavailable(f"the upstream cannot count tokens: "
                                             f"{type(exc).__name__}", retry_after_s=1.0) from None
        raise AssertionError("unreachable")


def _retry_after(resp: httpx.Response) -> float:
    """The upstream's Retry-After (``retry-after-ms`` first), or 1 s if it names none."""
    return retry_after_s(resp.headers, max_digits=_MAX_RETRY_DIGITS)


def _error_message(resp: httpx.Response) -> str | None:
    return _error_text(resp, "message")


def _error_field(resp: httpx.Response) -> str | None:
    return _error_text(resp, "param")


def _error_text(resp: httpx.Response, name: str) -> str | None:
    try:
        err = resp.json().get("error", {})
        value = err.get(name)
        return value if isinstance(value, str) else None
    except (ValueError, AttributeError):
        return None
