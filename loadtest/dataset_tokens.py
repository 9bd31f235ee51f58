"""Counting a dataset's prompt and answer tokens, for `loadtest/dataset.py`.

Two counters with one interface (``Counter``):

- ``TargetCounter`` asks the target itself: ``POST /v1/tokenize`` (the bundled backend;
  vLLM serves the same body at ``/tokenize``, tried when ``/v1/tokenize`` is 404). A chat
  prompt goes as ``messages``, which the server renders with its chat template before
  counting, so the count is the one ``usage.prompt_tokens`` will report: exact.
- ``LocalCounter`` encodes with a ``tokenizer.json`` (the ``tokenizers`` library). That file
  has no chat template, so a chat prompt counts as its message contents plus an overhead
  fitted once on the target (``ChatOverhead``): a per-conversation part and a per-message
  part, measured from three probe conversations. An approximation, so never ``exact``.

Answers (reference outputs) are counted as plain text without special tokens, since the
model generates them after the prompt.

Errors are this module's own and ``dataset.py`` translates them where it knows the file and
line: ``TokenizeUnavailable`` (no tokenize endpoint), ``PromptRefused`` (the target
answered 400 to one prompt). Anything else the target does wrong is a ``RuntimeError``,
as in ``client.calibrate``: the target cannot be measured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import tokenizers

from loadtest.urls import server_root

# A prompt as sent: chat messages, or the text of a completions prompt.
Prompt = tuple[dict[str, Any], ...] | str
ChatProbe = Callable[[list[dict[str, Any]]], Awaitable[int]]  # a conversation's count
_TOKENIZE_PATHS = ("/v1/tokenize", "/tokenize")  # the bundled backend's, vLLM's
CONCURRENCY = 16  # tokenize requests in flight at once
PROBE_TEXT = "The quick brown fox jumps over the lazy dog."


class TokenizeUnavailable(RuntimeError):
    """The target has no tokenize endpoint (404/405 on both paths)."""


class PromptRefused(ValueError):
    """The target refused to tokenize the prompt at ``index`` of the batch (HTTP 400/422)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class Counter(Protocol):
    describe: str  # for details.json: how the tokens were counted
    exact: bool  # prompt counts are the target's own

    async def count_prompts(self, prompts: Sequence[Prompt]) -> list[int]: ...

    async def count_answers(self, texts: Sequence[str]) -> list[int]: ...


def _model_error(resp: httpx.Response) -> bool:
    """A 404 about the model (the route exists), not about the route: OpenAI-style error
    bodies carry ``code: model_not_found`` or ``param: model``."""
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and (err.get("code") == "model_not_found"
                                      or err.get("param") == "model")


async def _bounded(fn: Callable[[int, Any], Awaitable[int]], items: Sequence[Any],
                   limit: int = CONCURRENCY) -> list[int]:
    """``fn(i, item)`` for every item, ``limit`` at a time. On failure the error of the
    lowest index is raised, so which entry an error names does not depend on timing."""
    sem = asyncio.Semaphore(limit)

    async def one(i: int, item: Any) -> int:
        async with sem:
            return await fn(i, item)

    results = await asyncio.gather(*(one(i, x) for i, x in enumerate(items)),
                                   return_exceptions=True)
    out: list[int] = []
    for r in results:
        if isinstance(r, BaseException):
            raise r
        out.append(r)
    return out


class TargetCounter:
    """Counts with the target's tokenize endpoint; exact for chat and completions alike."""

    exact = True

    def __init__(self, client: httpx.AsyncClient, base_url: str, key: str | None,
                 model: str) -> None:
        self._client = client
        self._root = server_root(base_url)
        self._path = 0  # index in _TOKENIZE_PATHS: the first that answers is kept
        self._headers = {"authorization": f"Bearer {key}"} if key else {}
        self._model = model
        self.describe = "target /v1/tokenize"

    async def tokenize(self, body: dict[str, Any], index: int = 0) -> int:
        """The token count of one tokenize body."""
        while True:
            k = self._path
            path = _TOKENIZE_PATHS[k]
            try:
                resp = await self._client.post(self._root + path, json=body,
                                               headers=self._headers)
            except httpx.HTTPError as exc:
                raise RuntimeError(f"cannot count tokens at {self._root}{path}: "
                                   f"{type(exc).__name__}: {exc}") from exc
            if resp.status_code not in (404, 405) or k + 1 == len(_TOKENIZE_PATHS):
                break
            if _model_error(resp):
                raise RuntimeError(f"{self._root}{path} answered HTTP {resp.status_code}: "
                                   f"{resp.text[:300]}")
            self._path = max(self._path, k + 1)  # requests in flight may have moved it on
        if resp.status_code in (404, 405) and not _model_error(resp):
            raise TokenizeUnavailable(f"{self._root} has no /v1/tokenize (nor /tokenize)")
        if resp.status_code in (400, 422):
            raise PromptRefused(index, f"HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code != 200:
            raise RuntimeError(f"{self._root}{path} answered HTTP {resp.status_code}: "
                               f"{resp.text[:300]}")
        self.describe = f"target {path}"
        try:
            obj = resp.json()
            return int(obj["count"]) if "count" in obj else len(obj["tokens"])
        except (ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"{self._root}{path} gave no token count: "
                               f"{resp.text[:300]}") from exc

    def _prompt_body(self, prompt: Prompt) -> dict[str, Any]:
        if isinstance(prompt, str):
            return {"model": self._model, "prompt": prompt}
        return {"model": self._model, "messages": list(prompt)}

    async def count_prompts(self, prompts: Sequence[Prompt]) -> list[int]:
        return await _bounded(lambda i, p: self.tokenize(self._prompt_body(p), i), prompts)

    async def count_answers(self, texts: Sequence[str]) -> list[int]:
        return await _bounded(lambda i, t: self.tokenize(
            {"model": self._model, "prompt": t, "add_special_tokens": False}, i), texts)


@dataclass(slots=True, frozen=True)
class ChatOverhead:
    """Chat template tokens around the message contents:
    ``base`` for a conversation of one user message (BOS, its markup, the generation
    prompt), plus ``per_system`` for each system message and ``per_turn`` for each further
    user or assistant message."""

    base: int
    per_system: int
    per_turn: float

    def of(self, messages: Sequence[dict[str, Any]]) -> int:
        systems = sum(1 for m in messages if m.get("role") == "system")
        turns = len(messages) - systems
        return max(0, round(self.base + self.per_system * systems
                            + self.per_turn * (turns - 1)))


# The three probe conversations ChatOverhead is fitted from.
PROBES: tuple[tuple[str, ...], ...] = (("user",), ("system", "user"),
                                       ("user", "assistant", "user"))


async def measure_overhead(count_chat: ChatProbe, content_tokens: int) -> ChatOverhead:
    """Fit ``ChatOverhead`` from the target's counts of the ``PROBES`` conversations, each
    message holding the same text of ``content_tokens`` tokens."""
    over = []
    for roles in PROBES:
        messages = [{"role": r, "content": PROBE_TEXT} for r in roles]
        over.append(await count_chat(messages) - content_tokens * len(roles))
    one, with_system, three = over
    return ChatOverhead(one, with_system - one, (three - one) / 2)


class TokenizerFileError(ValueError):
    """The ``tokenizer`` path has no usable tokenizer.json."""


def load_tokenizer(path: Path) -> tokenizers.Tokenizer:
    """A ``tokenizer.json``, or the one in directory ``path``."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerFileError(f"{path}: no tokenizer.json there")
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exception on a bad file
        raise TokenizerFileError(f"{file}: not a tokenizers file: {exc}") from exc


class LocalCounter:
    """Counts with a local tokenizer.json; chat prompts get a ``ChatOverhead`` added."""

    exact = False

    def __init__(self, tokenizer: tokenizers.Tokenizer, describe: str,
                 overhead: ChatOverhead | None = None) -> None:
        self._tok = tokenizer
        self._overhead = overhead
        self.describe = describe

    async def _lengths(self, texts: list[str], special: bool) -> list[int]:
        # encode_batch_fast runs in Rust threads; off the event loop all the same
        encs = await asyncio.to_thread(self._tok.encode_batch_fast, texts,
                                       add_special_tokens=special)
        return [len(e.ids) for e in encs]

    async def count_prompts(self, prompts: Sequence[Prompt]) -> list[int]:
        texts = [p for p in prompts if isinstance(p, str)]
        contents = [str(m.get("content", "")) for p in prompts if not isinstance(p, str)
                    for m in p]
        text_lens = iter(await self._lengths(texts, True))
        content_lens = iter(await self._lengths(contents, False))
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(next(text_lens))
            else:
                extra = self._overhead.of(p) if self._overhead is not None else 0
                out.append(sum(next(content_lens) for _ in p) + extra)
        return out

    async def count_answers(self, texts: Sequence[str]) -> list[int]:
        return await self._lengths(list(texts), False)


async def chat_probe(client: httpx.AsyncClient, base_url: str, key: str | None,
                     model: str) -> tuple[ChatProbe, str]:
    """How the target counts a chat prompt, and where that count comes from: its tokenize
    endpoint, or, without one, the ``usage.prompt_tokens`` of a one-token chat completion."""
    target = TargetCounter(client, base_url, key, model)
    try:
        await target.tokenize({"model": model, "messages": [{"role": "user",
                                                             "content": PROBE_TEXT}]})
    except TokenizeUnavailable:
        pass
    else:
        source = target.describe.removeprefix("target ")
        return (lambda messages: target.tokenize({"model": model, "messages": messages}),
                source)
    url = server_root(base_url) + "/v1/chat/completions"
    headers = {"authorization": f"Bearer {key}"} if key else {}

    async def completion(messages: list[dict[str, Any]]) -> int:
        body = {"model": model, "messages": messages, "max_tokens": 1, "stream": False}
        try:
            resp = await client.post(url, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"chat template probe failed: {type(exc).__name__}: "
                               f"{exc}") from exc
        if resp.status_code != 200:
            raise RuntimeError(f"chat template probe failed: HTTP {resp.status_code}: "
                               f"{resp.text[:300]}")
        try:
            return int(resp.json()["usage"]["prompt_tokens"])
        except (ValueError, KeyError, TypeError) as exc:
            raise RuntimeError("the target reports no usage.prompt_tokens; cannot measure "
                               "its chat template overhead") from exc

    return completion, "usage.prompt_tokens"


async def make_counter(client: httpx.AsyncClient, *, api: str, tokenizer: Path | None,
                       base_url: str, key: str | None, model: str) -> Counter:
    """The target's tokenize endpoint when ``tokenizer`` is None, else that tokenizer.json
    (for chat with the template overhead fitted on the target)."""
    if tokenizer is None:
        return TargetCounter(client, base_url, key, model)
    tok = load_tokenizer(tokenizer)
    where = f"tokenizer.json at {tokenizer}"
    if api != "chat":
        return LocalCounter(tok, where)
    probe, source = await chat_probe(client, base_url, key, model)
    content = len(tok.encode(PROBE_TEXT, add_special_tokens=False).ids)
    overhead = await measure_overhead(probe, content)
    return LocalCounter(tok, f"{where} (+ chat template overhead from the target's {source})",
                        overhead)
