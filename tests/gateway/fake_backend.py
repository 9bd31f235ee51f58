"""A scriptable stand-in for the bundled backend, on a real socket (uvicorn in a thread).

It reports resolved versions like `sluice backend` (``/v1/models`` + ``x-sluice-resolved``,
with the request's ``schema=``/``tools=`` on an answer to a request that has them), counts
tokens as whitespace-separated words of the JSON of what it renders (messages, tools,
response_format), and streams ``chunks`` words. ``mode`` makes it
misbehave: ``"500"``, ``"503"``, ``"400"``, ``"die"`` (drops the stream after two chunks),
``"hold"`` (streams two chunks, then waits for ``release``), ``"stall"`` (waits for
``release`` before answering at all), ``"slow"`` (each answer takes 50 ms).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Self

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.uvicorn_thread import UvicornThread


class FakeBackend:
    def __init__(self, name: str = "fake-model", chunks: int = 5) -> None:
        self.name = name
        self.chunks = chunks
        self.mode = "ok"
        self.revision = "a" * 64
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # of each generation request
        self.tokenized: list[dict[str, str]] = []  # the headers of each /v1/tokenize
        self.tokenize_bodies: list[dict[str, Any]] = []  # … and its body
        self.models_reads = 0  # GET /v1/models answered
        # (x-request-id, the revision it answered at, monotonic time) of each generation
        # answered 200
        self.served: list[tuple[str, str, float]] = []
        self.token_bound: dict[str, Any] | None = None  # reported in /v1/models if set
        self.aborted = 0  # streams the client (the gateway) left before the end
        self.finished = 0
        self.release = threading.Event()
        app = Starlette(routes=[
            Route("/v1/models", self._models),
            Route("/health", self._health),
            Route("/v1/tokenize", self._tokenize, methods=["POST"]),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/v1/completions", self._generate, methods=["POST"]),
        ])
        self.http = UvicornThread(app, "fake backend")
        self.port, self.url, self.server = self.http.port, self.http.url, self.http.server

    # ---- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Self:
        self.http.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.http.stop()

    @property
    def open_connections(self) -> int:
        return len(self.server.server_state.connections)

    # ---- what it reports ----------------------------------------------------------------
    # ``revision`` is read once per answer and passed down, so that an answer's body and
    # headers name one revision even while a test changes it from another thread
    def resolved(self, revision: str | None = None) -> dict[str, Any]:
        return {"model": self.name, "revision": revision or self.revision,
                "tokenizer": "b" * 64, "chat_template": "c" * 64, "engine": "fake-engine/1"}

    def header(self, revision: str | None = None) -> str:
        r = self.resolved(revision)
        return f"model={self.name}; revision={r['revision'][:12]}; engine=fake"

    def _headers(self, revision: str | None = None,
                 body: dict[str, Any] | None = None) -> dict[str, str]:
        value = self.header(revision)
        if body is not None and body.get("response_format"):  # the request's own versions
            value += "; schema=" + "5" * 12
        if body is not None and body.get("tools"):
            value += "; tools=" + "7" * 12
        return {"x-sluice-resolved": value}

    async def _models(self, request: Request) -> Response:
        self.models_reads += 1
        revision = self.revision
        entry = {"id": self.name, "object": "model", "max_model_len": 4096,
                 "revision": revision, "resolved": self.resolved(revision)}
        if self.token_bound is not None:
            entry["token_bound"] = self.token_bound
        return JSONResponse({"object": "list", "data": [entry]},
                            headers=self._headers(revision))

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _tokenize(self, request: Request) -> Response:
        self.tokenized.append(dict(request.headers))
        body = await request.json()
        self.tokenize_bodies.append(body)
        rendered = [body.get(k) for k in ("messages", "prompt", "tools", "response_format")
                    if body.get(k) is not None]
        text = json.dumps(rendered[0] if len(rendered) == 1 else rendered)
        return JSONResponse({"count": len(text.split()), "tokens": []})

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.mode == "slow":  # every answer takes ~50 ms: a saturated upstream
            await asyncio.sleep(0.05)
        if self.mode == "stall":
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        if self.mode in ("500", "503", "400"):
            status = int(self.mode)
            return JSONResponse({"error": {"message": "boom: Traceback (most recent call)",
                                           "type": "x", "code": "oops", "param": None}},
                                status_code=status, headers={"retry-after": "7"})
        revision = self.revision  # what this answer is made with
        self.served.append((request.headers.get("x-request-id", ""), revision,
                            time.monotonic()))
        chat = request.url.path.endswith("chat/completions")
        usage_asked = bool((body.get("stream_options") or {}).get("include_usage"))
        running = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
        base = {"id": "x", "created": 1, "model": self.name, "system_fingerprint": "fp_up",
                "object": "chat.completion.chunk" if chat else "text_completion"}

        def choice(i: int, last: bool) -> dict[str, Any]:
            reason = "length" if last else None
            if chat:
                return {"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": reason}
            return {"index": 0, "text": f" w{i}", "finish_reason": reason}

        def usage(n: int) -> dict[str, int]:
            return {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}

        if not body.get("stream"):
            text = "".join(f" w{i}" for i in range(self.chunks))
            msg = {"index": 0, "finish_reason": "length",
                   **({"message": {"role": "assistant", "content": text}} if chat
                      else {"text": text})}
            return JSONResponse({**base, "object": "chat.completion" if chat else
                                 "text_completion", "choices": [msg],
                                 "usage": usage(self.chunks)},
                                headers=self._headers(revision, body))

        async def events() -> Any:
            try:
                for i in range(self.chunks):
                    if self.mode == "die" and i == 2:
                        raise RuntimeError("the fake backend dies mid-stream")
                    if self.mode == "hold" and i == 2:
                        while not self.release.is_set():
                            await asyncio.sleep(0.01)
                    last = i == self.chunks - 1
                    obj = {**base, "choices": [choice(i, last)]}
                    if usage_asked:
                        obj["usage"] = usage(i + 1) if running else None
                    yield f"data: {json.dumps(obj)}\n\n"
                if usage_asked:
                    yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage(self.chunks)})}\n\n"
                yield "data: [DONE]\n\n"
                self.finished += 1
            except asyncio.CancelledError:
                self.aborted += 1
                raise

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers=self._headers(revision, body))
