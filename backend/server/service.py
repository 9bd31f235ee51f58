"""The model service behind the HTTP routes: request → engine inputs, and engine → answers.

One ``ModelService`` is built per app in the lifespan and kept on ``app.state.service``;
it owns the engine, the metrics and the set of engine request ids in flight.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from backend.engine.async_engine import AsyncEngine, RequestStream
from backend.engine.errors import PromptTooLongError
from backend.engine.outputs import OutputDelta
from backend.engine.sampling import SamplingParams

from .errors import BadRequest, ModelNotFound
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, Kind, TokenizeRequest


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
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id


def validation_error(exc: ValidationError) -> BadRequest:
    """The first pydantic error as an OpenAI 400 naming the field."""
    err = exc.errors(include_url=False)[0]
    loc = err.get("loc", ())
    param = str(loc[0]) if loc else None
    where = ".".join(str(p) for p in loc)
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        return BadRequest(f"missing required field {where!r}", param)
    if not loc:
        return BadRequest(f"the body must be a JSON object: {msg}", None)
    return BadRequest(f"invalid value for {where!r}: {msg}", param)


class ModelService:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics | None = None) -> None:
        if engine.parts is None:
            raise ValueError("the service needs an engine built from a config (engine.parts)")
        self.engine = engine
        self.parts = engine.parts
        self.tokenizer = engine.parts.tokenizer
        self.versions = engine.parts.versions
        self.model_name = engine.parts.model_name
        self.max_model_len = engine.core.max_model_len
        self.fingerprint = self.versions.fingerprint()
        self.resolved_header = self.versions.header_value().encode("latin-1", "replace")
        self.metrics = metrics or ServerMetrics()
        self.created = int(time.time())
        self._inflight: set[str] = set()
        self._suffix = itertools.count(1)

    # ---- request ids --------------------------------------------------------------------
    def claim_id(self, wanted: str | None) -> str:
        rid = wanted or uuid.uuid4().hex
        while rid in self._inflight:
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
            revision = self.versions.revision
            if rev and (revision == rev or (len(rev) >= 7 and revision.startswith(rev))):
                return
            raise BadRequest(f"model {name!r} is served at revision {revision[:12]!r}, "
                             f"not {rev!r}", "model", code="revision_mismatch")
        raise ModelNotFound(f"the model {model!r} does not exist; this server serves "
                            f"{self.model_name!r}", "model")

    def encode_messages(self, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages,
                                                  add_generation_prompt=add_generation_prompt)
        # The rendered template carries its own special tokens (bos), as with HF/vLLM.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_prompt(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                return self.encode_prompt(prompt[0])
            if prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if prompt and all(isinstance(t, (str, list)) for t in prompt):
                raise BadRequest("batched prompts are not supported: send one prompt "
                                 "per request", "prompt")
        raise BadRequest("prompt must be a non-empty string or list of token ids", "prompt")

    def prepare(self, kind: Kind, body: dict[str, Any], request_id: str | None) -> Prepared:
        """Validate a chat or completion body; raises ApiError or engine errors."""
        try:
            req: ChatCompletionRequest | CompletionRequest = (
                ChatCompletionRequest.model_validate(body) if kind == "chat"
                else CompletionRequest.model_validate(body))
        except ValidationError as exc:
            raise validation_error(exc) from None
        self.check_model(req.model)
        req.check_supported()
        if isinstance(req, ChatCompletionRequest):
            prompt_ids = self.encode_messages(req.messages)
        else:
            prompt_ids = self.encode_prompt(req.prompt)
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {n}", "messages" if kind == "chat" else "prompt")
        params = req.sampling_params(n, self.max_model_len)
        self.engine.core.validate(prompt_ids, params)
        return Prepared(
            kind=kind, request_id=request_id or "", prompt_ids=prompt_ids, params=params,
            priority=req.priority or 0, cache_salt=req.cache_salt or None,
            stream=bool(req.stream), include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            model=self.model_name, fingerprint=self.fingerprint)

    # ---- generation ---------------------------------------------------------------------
    async def open(self, p: Prepared) -> RequestStream:
        """The engine's stream of deltas for ``p`` (``p.request_id`` claimed beforehand).

        Closing the stream, or cancelling the task reading it, aborts the request in the
        engine unless it finished. Call ``finished(delta)`` on the final delta.
        """
        return await self.engine.generate(p.request_id, p.prompt_ids, p.params,
                                          priority=p.priority, cache_salt=p.cache_salt)

    def finished(self, delta: OutputDelta) -> None:
        self.metrics.observe_finished(delta)

    # ---- read-only endpoints ------------------------------------------------------------
    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            req = TokenizeRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give exactly one of 'prompt' or 'messages'", "prompt")
        if req.messages is not None:
            tokens = self.encode_messages(req.messages, bool(req.add_generation_prompt))
        elif isinstance(req.prompt, str):
            add = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=add)
        else:
            tokens = self.encode_prompt(req.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    def models(self) -> dict[str, Any]:
        v = self.versions
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "sluice", "max_model_len": self.max_model_len,
            "revision": v.revision, "tokenizer": v.tokenizer, "chat_template": v.chat_template,
            "engine": v.engine, "system_fingerprint": self.fingerprint,
            "resolved": v.as_dict(),
        }]}

    def state(self) -> dict[str, Any]:
        out = self.engine.state().as_dict()
        out["resolved"] = self.versions.as_dict()
        out["system_fingerprint"] = self.fingerprint
        out["model"] = self.model_name
        out["inflight_requests"] = self.num_inflight
        return out

