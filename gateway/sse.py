"""Rewriting the upstream's SSE events for the client.

Each event gets the public model name and the gateway's ``system_fingerprint``, and its
``usage`` as the client asked: dropped, ``null`` on content chunks (``include_usage``), or
running counts (``continuous_usage_stats``). The last usage seen is kept for settlement.

The first event is rewritten through ``json``; it also teaches the rewriter the exact bytes
the upstream writes for its model and fingerprint fields (servers serialize every chunk of a
stream the same way). Later events are rewritten by replacing those bytes and cutting the
usage member, which costs a few byte scans instead of a parse and a dump per event. Any
event that does not look exactly as expected (a field missing or repeated, an error) takes
the ``json`` path, so the fast path never guesses.

What the client gets of the upstream's SSE fields: the data of its ``message`` (untyped) and
``error`` events, as one ``data:`` line; comments, as they are (they keep idle connections
open). Nothing else: ``id:`` and ``retry:`` mean nothing to the gateway's client, and the
OpenAI SDKs read an event with any field but no data as one with empty data, which fails
their JSON parse (an ``id`` even makes every later comment such an event). Events of other
types (``event: ping``) and empty data are not chunks a client waits for: dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

from protocol.sse import DONE, dumps, parse_event

from .errors import BadGateway

__all__ = ["ChunkRewriter"]
# A usage object: numbers and at most one level of nested objects (…_tokens_details).
_USAGE_OBJECT = re.compile(rb"\{(?:[^{}]|\{[^{}]*\})*\}")
# A chunk that carries output tokens: a non-empty "content" or "refusal" (chat delta) or
# "text" (completion), or a non-empty "tool_calls" list (a call's first delta, with its
# name, or a piece of its arguments). Role, finish and usage chunks carry none. (Within a
# JSON string a quote is escaped: these never match inside one.)
_OUTPUT = re.compile(rb'"(?:content|refusal|text)"\s*:\s*"(?!")|"tool_calls"\s*:\s*\[\s*\{')
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z_]{1,32})"')
# what _learn finds: model pattern and replacement, fingerprint ditto, usage key, no choices
_Fast = tuple[bytes, bytes, bytes, bytes, bytes, bytes]
_CHUNK_TYPES = (b"message", b"error")  # event types whose data the client gets


def _comments(event: bytes) -> bytes | None:
    """The comment lines of an event without data, as an event for the client (or None)."""
    if event[:1] == b":" and 10 not in event:  # the usual keep-alive (10: LF)
        return event + b"\n\n"
    kept = [line for line in event.split(b"\n") if line[:1] == b":"]
    return b"\n".join(kept) + b"\n\n" if kept else None


def _carries_output(choice: dict[str, Any]) -> bool:
    """Whether a chunk's choice carries output tokens (the json path's ``_OUTPUT``)."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        text = choice.get("text")
        return isinstance(text, str) and bool(text)
    calls = delta.get("tool_calls")
    if isinstance(calls, list) and calls and isinstance(calls[0], dict):
        return True
    return any(isinstance(delta.get(k), str) and delta[k] for k in ("content", "refusal"))


def _encodings(value: str) -> list[bytes]:
    """The ways a JSON encoder may write a string value."""
    forms = {json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode()}
    return sorted(forms)


def _find_member(data: bytes, key: str, value: str) -> tuple[bytes, bytes] | None:
    """The exact bytes of ``"key":value`` in ``data`` (compact or spaced), found once."""
    for sep in (b":", b": "):
        for encoded in _encodings(value):
            pattern = b'"' + key.encode() + b'"' + sep + encoded
            if data.count(pattern) == 1:
                return pattern, sep
    return None


class ChunkRewriter:
    __slots__ = (
        "_fast",
        "_last_usage",
        "chunks",
        "client_continuous",
        "client_usage",
        "done",
        "error",
        "fingerprint",
        "finish_reason",
        "model",
        "tokens",
        "usage_seen",
    )

    def __init__(self, model: str, fingerprint: str, client_usage: bool,
                 client_continuous: bool) -> None:
        self.model = model
        self.fingerprint = fingerprint
        self.client_usage = client_usage
        self.client_continuous = client_continuous
        self.chunks = 0  # events with choices relayed
        self.tokens = 0  # … of them, those carrying output: text or tool calls (not a role
        # or a finish): what times the first token, TPOT and ITL
        self.done = False  # [DONE] seen
        self.error = False  # an error event seen
        self.usage_seen = False
        self.finish_reason: str | None = None  # the first choice's, once the upstream says
        self._last_usage: Any = None  # a dict, or the raw bytes of the fast path
        # (model pattern, its replacement, fp pattern, its replacement, usage key, choices=[])
        self._fast: _Fast | None = None

    @property
    def usage(self) -> dict[str, Any] | None:
        """The last usage the upstream reported."""
        raw = self._last_usage
        if isinstance(raw, bytes):
            try:
                raw = json.loads(raw)
            except ValueError:
                raw = None
            self._last_usage = raw
        return raw if isinstance(raw, dict) else None

    def rewrite(self, event: bytes) -> bytes | None:
        """One event (lines joined by LF, as ``protocol.sse.EventSplitter`` gives them) for
        the client, or None to drop it."""
        if event.startswith(b"data: ") and 10 not in event:  # one data line (10: LF, memchr)
            data = event[6:]
        else:
            fields = parse_event(event)
            if fields.data is None:
                return _comments(event)
            if fields.type not in _CHUNK_TYPES:
                return None
            data = fields.data.strip()
            if 10 in data:  # several data lines (LF): only the json path writes them as one
                return self._rewrite_json(data)
        if data == b"[DONE]":
            self.done = True
            return DONE
        fast = self._fast
        if fast is not None:
            out = self._rewrite_fast(data, fast)
            if out is not None:
                return out or None
        return self._rewrite_json(data)

    # ---- the general path -------------------------------------------------------------------
    def _rewrite_json(self, data: bytes) -> bytes | None:
        try:
            obj = json.loads(data)
        except ValueError:
            if not data.strip():
                return None  # empty data: no chunk (checked only here, off the hot path)
            raise BadGateway("the upstream sent a broken stream event") from None
        if not isinstance(obj, dict):
            raise BadGateway("the upstream sent a broken stream event")
        if "error" in obj:
            self.error = True
            return b"data: " + data + b"\n\n"
        if self._fast is None and self.chunks < 3:
            self._learn(data, obj)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._last_usage = usage
            self.usage_seen = True
        choices = obj.get("choices")
        if choices:
            self.chunks += 1
            first = choices[0] if isinstance(choices, list) else None
            if isinstance(first, dict):
                if isinstance(first.get("finish_reason"), str):
                    self.finish_reason = first["finish_reason"]
                if _carries_output(first):
                    self.tokens += 1
        obj["model"] = self.model
        obj["system_fingerprint"] = self.fingerprint
        if not choices and usage is not None:  # the usage chunk
            if not self.client_usage:
                return None
        elif "usage" in obj:
            if not self.client_usage:
                del obj["usage"]
            elif not self.client_continuous:
                obj["usage"] = None
        return b"data: " + dumps(obj).encode() + b"\n\n"

    def _learn(self, data: bytes, obj: dict[str, Any]) -> None:
        model, fp = obj.get("model"), obj.get("system_fingerprint")
        if not isinstance(model, str) or not isinstance(fp, str) or "usage" not in obj:
            return  # nothing stable to replace: every event takes the json path
        found_model = _find_member(data, "model", model)
        found_fp = _find_member(data, "system_fingerprint", fp)
        if found_model is None or found_fp is None:
            return
        (model_pat, sep), (fp_pat, _) = found_model, found_fp
        comma = b"," if sep == b":" else b", "  # compact, or json.dumps' default spacing
        usage_key = comma + b'"usage"' + sep
        if data.count(usage_key) != 1:
            return
        self._fast = (model_pat, b'"model"' + sep + dumps(self.model).encode(),
                      fp_pat, b'"system_fingerprint"' + sep + dumps(self.fingerprint).encode(),
                      usage_key, b'"choices"' + sep + b"[]")

    # ---- the fast path ----------------------------------------------------------------------
    def _rewrite_fast(self, data: bytes, fast: _Fast) -> bytes | None:
        """The rewritten event, b"" to drop it, or None when the json path must decide."""
        model_pat, model_rep, fp_pat, fp_rep, usage_key, no_choices = fast
        if data.count(model_pat) != 1 or data.count(fp_pat) != 1 or b'"error"' in data \
                or data.count(usage_key) != 1 or data[-1:] != b"}":
            return None
        at = data.find(usage_key)
        value_at = at + len(usage_key)
        if data.startswith(b"null", value_at):
            end = value_at + 4
            usage: bytes | None = None
        else:
            m = _USAGE_OBJECT.match(data, value_at)
            if m is None:
                return None
            end = m.end()
            usage = m.group()
        usage_chunk = no_choices in data
        if usage_chunk and usage is None:
            return None  # a chunk without choices nor usage: let the json path judge
        if usage is not None:
            self._last_usage = usage
            self.usage_seen = True
        if not usage_chunk:
            self.chunks += 1
            if _OUTPUT.search(data) is not None:
                self.tokens += 1
            at = data.find(b'"finish_reason"')
            if at >= 0:
                m = _FINISH.match(data, at)
                if m is not None:
                    self.finish_reason = m.group(1).decode()
        if model_pat != model_rep:
            data = data.replace(model_pat, model_rep)
        data = data.replace(fp_pat, fp_rep)
        if usage_chunk:
            if not self.client_usage:
                return b""
        elif not self.client_usage:
            at = data.find(usage_key)  # offsets moved with the replacements
            data = data[:at] + data[at + len(usage_key) + (end - value_at):]
        elif not self.client_continuous and usage is not None:
            at = data.find(usage_key) + len(usage_key)
            data = data[:at] + b"null" + data[at + (end - value_at):]
        return b"data: " + data + b"\n\n"
