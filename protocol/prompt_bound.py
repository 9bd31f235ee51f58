"""A prompt's tokens, bounded from below without tokenizing it; and how a server reports it.

With a tokenizer whose longest token covers ``max_token_bytes`` bytes of text
(``modelfiles.token_bound`` says when that holds), a text of ``B`` UTF-8 bytes has at least
``ceil(B / max_token_bytes)`` tokens. Both servers apply it twice:

* ``over``, on the event loop, before any other work: the texts the request certainly
  holds (a completion's ``prompt`` string; a chat's message ``content`` strings and
  ``{"type": "text"}`` parts), counted in characters, a lower bound of their UTF-8 bytes.
  O(1) per message and part (``len``, ``str.isascii``; exact-type checks, no ``Mapping``
  ABC), and it looks at the first ``LOOP_NODES`` messages and parts only (the contract caps
  messages at 2048, but not the parts of one): a partial sum is still a lower bound. It
  refuses a single huge text without a thread hop, in ~1 µs. It assumes a
  chat template renders each message's text, as the common ones do; one that drops text
  could see a prompt refused that it would have shortened, never one admitted that is over.
* ``over_text``, in the tokenize worker, on the rendered prompt: exactly the text the
  tokenizer would encode (the template's markup, roles, tool calls and tools included), in
  UTF-8 bytes. Sound by construction, whatever the template; a prompt over the limit is
  refused before it is encoded.

The bundled backend reports the figure in its ``/v1/models`` entry, where the gateway reads
it:

    "token_bound": {"max_token_bytes": 17, "ascii_only": false}

absent when the tokenizer allows no sound bound. ``ascii_only``: the bound holds for ASCII
text only (a Unicode normalizer), so a prompt with other text is not bounded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

FIELD = "token_bound"
LOOP_NODES = 8192  # messages and content parts ``over`` looks at: ~1 ms at most


class TokenWidth(Protocol):
    """What ``modelfiles.token_bound.LongestToken`` holds (protocol imports no model code)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def ascii_only(self) -> bool: ...


@dataclass(slots=True, frozen=True)
class PromptBound:
    max_token_bytes: int
    ascii_only: bool = False

    @classmethod
    def of(cls, longest: TokenWidth | None) -> PromptBound | None:
        """The bound a tokenizer's longest token gives (None: the tokenizer allows none)."""
        return None if longest is None else cls(longest.nbytes, longest.ascii_only)

    def report(self) -> dict[str, Any]:
        """The ``token_bound`` value of a ``/v1/models`` entry."""
        return {"max_token_bytes": self.max_token_bytes, "ascii_only": self.ascii_only}

    @classmethod
    def from_report(cls, entry: Mapping[str, Any]) -> PromptBound | None:
        """From a ``/v1/models`` entry; None when it reports none (or nonsense)."""
        value = entry.get(FIELD)
        if not isinstance(value, Mapping):
            return None
        width, ascii_only = value.get("max_token_bytes"), value.get("ascii_only", False)
        if type(width) is not int or width < 1 or not isinstance(ascii_only, bool):
            return None
        return cls(width, ascii_only)

    def over(self, kind: str, payload: Any, limit: int) -> int | None:
        """At least this many tokens, when that is more than ``limit``, from the request's
        texts alone (their characters: no text is encoded here); None when it may fit or
        cannot be bounded (non-ASCII text under ``ascii_only``)."""
        chars = 0
        for text in prompt_texts(kind, payload, LOOP_NODES):
            if self.ascii_only and not text.isascii():
                return None
            chars += len(text)  # a character is at least one UTF-8 byte
        at_least = -(-chars // self.max_token_bytes)
        return at_least if at_least > limit else None

    def over_text(self, text: str, limit: int) -> int | None:
        """``over`` for the exact text the tokenizer would encode, in UTF-8 bytes: for the
        worker, after the chat template has rendered it."""
        if text.isascii():
            nbytes = len(text)
        elif self.ascii_only:
            return None
        else:  # a lone surrogate is refused at parsing; here it would count its 3 bytes
            nbytes = len(text.encode("utf-8", "surrogatepass"))
        at_least = -(-nbytes // self.max_token_bytes)
        return at_least if at_least > limit else None


def prompt_texts(kind: str, payload: Any, max_nodes: int | None = None) -> Iterator[str]:
    """The text a prompt certainly holds: the completion string, or each message's text,
    from the first ``max_nodes`` messages and content parts (None: all). Only exact JSON
    types count (``dict``, ``list``, ``str``: what a parsed body holds)."""
    if kind != "chat":
        if type(payload) is list and len(payload) == 1:
            payload = payload[0]
        if type(payload) is str:
            yield payload
        return
    if type(payload) is not list:
        return
    most = math.inf if max_nodes is None else max_nodes
    seen = 0
    for message in payload:
        seen += 1
        if seen > most:
            return
        if type(message) is not dict:
            continue
        content = message.get("content")
        if type(content) is str:
            yield content
        elif type(content) is list:
            for part in content:
                seen += 1
                if seen > most:
                    return
                if type(part) is dict and part.get("type") == "text":
                    text = part.get("text")
                    if type(text) is str:
                        yield text
