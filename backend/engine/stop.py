"""Stop-string matching over streamed text, across token boundaries."""

from __future__ import annotations


class StopStringMatcher:
    """Holds back any text that might be the start of a stop string.

    ``feed(delta)`` returns (text safe to emit now, whether a stop string matched). On a
    match the stop string and everything after it are dropped, as OpenAI does.
    """

    __slots__ = ("_held", "_stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self._stops:
            return delta, False
        text = self._held + delta
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        hold = self._partial_suffix(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """The held-back text, when generation ends without a match."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
