"""Hostile request input for the fuzz suites (hypothesis strategies): raw bytes, JSON trees
(lone surrogates, huge integers, NaN, deep nesting), bodies built around a valid request,
and header values as raw bytes (non-ASCII digits, thousands of digits, control bytes).

A body is bytes: JSON text written with ``ensure_ascii=True`` (so a lone surrogate in a
string becomes the ``\\ud800`` escape a client can send), or raw bytes (invalid UTF-8, the
UTF-8 bytes of a surrogate, truncated JSON)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# every code point, surrogates included (hypothesis leaves category Cs out by default)
any_char = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
texts = st.text(any_char, max_size=24) | st.sampled_from(
    ["\ud800", "a\udc80b", "\ud83d", "\ud83d\ude00", "²", "\x00", "", "word " * 50])
numbers = (st.integers(-2**70, 2**70) | st.sampled_from([10**400, -10**400, 2**63, 2**64])
           | st.floats(allow_nan=True, allow_infinity=True))
scalars = st.none() | st.booleans() | numbers | texts
json_trees = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=16)


def nested(depth: int, leaf: Any = "hi") -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


deep = st.integers(1, 1200).map(nested)

CHAT_FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens",
               "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed", "user",
               "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "tools",
               "tool_choice", "response_format", "priority", "deadline_ms", "cache_salt",
               "top_k", "ignore_eos", "echo", "suffix", "best_of", "metadata", "min_tokens",
               "stop_token_ids", "unknown_field"]


def bodies(model: str) -> st.SearchStrategy[bytes]:
    """Request bodies around ``model``: a valid small request with hostile fields mixed
    in, hostile content, arbitrary JSON, and raw bytes."""
    good_chat = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 3}
    content = texts | deep | json_trees | st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=3)
    hostile_chat = st.builds(
        lambda c, extra: {**good_chat, "messages": [{"role": "user", "content": c}],
                          **extra},
        content, st.dictionaries(st.sampled_from(CHAT_FIELDS), json_trees, max_size=3))
    with_stream = st.builds(lambda b, s: {**b, "stream": s, "max_tokens": 3}, hostile_chat,
                            st.booleans())
    prompts = st.builds(lambda p: {"model": model, "prompt": p, "max_tokens": 3},
                        texts | deep | json_trees)
    as_json = st.one_of(hostile_chat, with_stream, prompts, json_trees,
                        st.dictionaries(st.sampled_from(CHAT_FIELDS), json_trees, max_size=6)
                        ).map(lambda v: json.dumps(v, ensure_ascii=True).encode())
    raw = st.binary(max_size=256) | st.sampled_from([
        b"{", b"\xff\xfe", b'{"prompt": "\xed\xa0\x80", "model": "' + model.encode() + b'"}',
        b'{"model": "' + model.encode() + b'", "prompt": "\\ud800"}', b"[" * 5000,
        b'{"a":' * 3000, b"\xef\xbb\xbf{}", b"null", b"1e999"])
    return as_json | raw


header_values = st.binary(max_size=40) | st.sampled_from(
    [b"\xb2", b"1\xb2", b"9" * 5000, b"-1", b" 5", b"0", b"1" * 19, b"12", b"\x00", b"1e3"])


def headers(*names: str) -> st.SearchStrategy[list[tuple[bytes, bytes]]]:
    """Some of ``names`` with hostile values; header values never hold CR or LF (no HTTP
    client sends those, and the server's parser refuses them before the app)."""
    value = header_values.map(lambda v: v.replace(b"\r", b"").replace(b"\n", b""))
    return st.lists(st.tuples(st.sampled_from([n.encode() for n in names]), value),
                    max_size=3)


async def raw_request(port: int, method: str, path: str,
                      headers: list[tuple[bytes, bytes]], body: bytes,
                      timeout: float = 30.0) -> tuple[int, bytes]:
    """One HTTP/1.1 request over a raw socket (headers exactly as given, bytes and all),
    ``connection: close``; (status, whole response). A server that hangs fails the test:
    ``TimeoutError`` after ``timeout`` seconds."""
    import asyncio

    head = [f"{method} {path} HTTP/1.1".encode(), b"host: 127.0.0.1",
            b"connection: close", f"content-length: {len(body)}".encode()]
    head += [name + b": " + value for name, value in headers]
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
            await writer.drain()
            response = await reader.read()
        finally:
            writer.close()
    status_line = response.split(b"\r\n", 1)[0].split()
    return (int(status_line[1]) if len(status_line) > 1 else 0), response
