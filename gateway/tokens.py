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
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import httpx

from modelfiles.errors import ModelFileError

from .errors import BadGateway, BadRequest, ServiceUnavailable

BYTE_BOUND_OVERHEAD = 16
_OFFLOAD_BYTES = 32 * 1024  # tokenize larger inputs in a worker thread, off the event loop
_CACHE_SIZE = 4096


class TokenCounter(Protocol):
    exact: bool
    name: str

    async def count(self, kind: str, payload: Any, tools: Any = None) -> int:
        """Prompt tokens of a chat (``payload`` = messages) or completion (the prompt)."""
        ...


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


def _text_size(payload: Any) -> int:
    """About how much text there is to tokenize, without serializing it (hot path)."""
    if isinstance(payload, str):
        return len(payload)
    if not isinstance(payload, list):
        return 0
    n = 0
    for item in payload:
        if isinstance(item, str):
            n += len(item)
        elif isinstance(item, dict):
            content = item.get("content")
            n += len(content) if isinstance(content, str) else len(str(content))
        else:
            n += 8  # a token id, or a list of them
    return n


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

    async def count(self, kind: str, payload: Any, tools: Any = None) -> int:
        ids = _token_ids(payload) if kind == "completion" else None
        if ids is not None:
            return len(ids)
        n = len(_json_bytes(payload)) + BYTE_BOUND_OVERHEAD
        if tools:
            n += len(_json_bytes(tools))
        return n


class LocalCounter:
    """The model's tokenizer, loaded in-process (no torch: tokenizers + jinja2 only)."""

    exact = True

    def __init__(self, model_dir: str | Path) -> None:
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

    def _count(self, kind: str, payload: Any, tools: Any) -> int:
        tok = self.tokenizer
        try:
            if kind == "chat":
                text = tok.apply_chat_template(payload, add_generation_prompt=True, tools=tools)
                return len(tok.encode(text, add_special_tokens=False))
            ids = _token_ids(payload)
            if ids is not None:
                return len(ids)
            if isinstance(payload, list) and len(payload) == 1:
                payload = payload[0]
            if not isinstance(payload, str):
                raise BadRequest("prompt must be a string or a list of token ids", "prompt")
            return len(tok.encode(payload))
        except ModelFileError as exc:
            raise BadRequest(f"cannot render the prompt: {exc}",
                             "messages" if kind == "chat" else "prompt") from None

    async def count(self, kind: str, payload: Any, tools: Any = None) -> int:
        if _text_size(payload) > _OFFLOAD_BYTES:
            return await asyncio.to_thread(self._count, kind, payload, tools)
        return self._count(kind, payload, tools)


class UpstreamCounter:
    """``POST /v1/tokenize`` on the upstream, cached per tokenizer and template version."""

    exact = True
    name = "upstream"

    def __init__(self, client: httpx.AsyncClient, model: str, version_key: Any,
                 servers: Callable[[], list[str]] | None = None) -> None:
        self._client = client
        self._servers = servers  # a pool's base URLs, healthiest first: tried in turn
        self._model = model
        self._version_key = version_key  # callable -> str naming tokenizer + template
        self._cache = _Lru()

    async def count(self, kind: str, payload: Any, tools: Any = None) -> int:
        if kind == "completion":
            ids = _token_ids(payload)
            if ids is not None:
                return len(ids)
            if isinstance(payload, list) and len(payload) == 1:
                payload = payload[0]
        key = hashlib.blake2b(
            str(self._version_key()).encode() + b"\0" + kind.encode() + b"\0"
            + _json_bytes(payload), digest_size=16).digest()
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        body: dict[str, Any] = {"model": self._model}
        body["messages" if kind == "chat" else "prompt"] = payload
        resp = await self._post(body)
        if resp.status_code == 400:
            message = _error_message(resp) or "the upstream refused the prompt"
            raise BadRequest(message, "messages" if kind == "chat" else "prompt")
        if resp.status_code != 200:
            raise BadGateway(f"the upstream's /v1/tokenize answered {resp.status_code}")
        try:
            count = int(resp.json()["count"])
        except (ValueError, KeyError, TypeError):
            raise BadGateway("the upstream's /v1/tokenize answer has no count") from None
        self._cache.put(key, count)
        return count


    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        urls = self._servers() if self._servers is not None else [""]
        for i, base in enumerate(urls):
            try:
                return await self._client.post(base + "/v1/tokenize", json=body)
            except httpx.TransportError as exc:
                if i == len(urls) - 1:
                    raise ServiceUnavailable(f"the upstream cannot count tokens: "
                                             f"{type(exc).__name__}", retry_after_s=1.0) from None
        raise AssertionError("unreachable")


def _error_message(resp: httpx.Response) -> str | None:
    try:
        err = resp.json().get("error", {})
        msg = err.get("message")
        return msg if isinstance(msg, str) else None
    except (ValueError, AttributeError):
        return None
