"""Prompts of a requested token length, for any target's tokenizer.

The client cannot know an arbitrary server's tokenizer, so it builds prompts from a fixed
list of common English words and calibrates, once per run, how many prompt tokens a word
costs on that target: two probe requests (``max_tokens: 1``) of K1 and K2 words, whose
``usage.prompt_tokens`` give a per-word cost and the fixed overhead (chat template, BOS).
That works against Sluice, vLLM or OpenAI alike. Every request records the prompt tokens
the server actually counted, so any residual error shows in the report instead of hiding.

Each prompt is a different seeded draw of the words (salted per run), so requests share
no accidental prefix, within a run or across runs (which a prefix cache would reward); a class with a ``prefix_group`` starts with
that group's fixed text instead, exactly as shared system prompts do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORD_TEXT = """
time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
"""
WORDS = tuple(_WORD_TEXT.split())
PROBE_WORDS = (1, 200)  # the short probe pins the overhead, the long one the slope


@dataclass(slots=True, frozen=True)
class Calibration:
    """prompt_tokens ~= overhead + per_word * words, measured on the target."""

    per_word: float
    overhead: float

    @staticmethod
    def from_probes(k1: int, p1: int, k2: int, p2: int) -> Calibration:
        per_word = max(0.1, (p2 - p1) / (k2 - k1))
        return Calibration(per_word, max(0.0, p1 - per_word * k1))

    def words_for(self, tokens: float, with_overhead: bool = True) -> int:
        left = tokens - (self.overhead if with_overhead else 0.0)
        return max(1, round(left / self.per_word))


def words(seed: int, n: int) -> str:
    """``n`` words in an order fixed by ``seed``."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


class PromptBook:
    """The prompt text of each request, fixed by the seed, a per-run salt and the index.

    The salt matters: runs against the same target (a sweep, 1x then 2x) would otherwise
    send the same prompts again, and the target's prefix cache would serve the later runs
    cheaper than new traffic. Shared prefixes stay the same across runs, as a system
    prompt does."""

    def __init__(self, calibration: Calibration, seed: int, prefixes: dict[str, int],
                 salt: int = 0, counts: dict[str, int] | None = None) -> None:
        self.cal = calibration
        self.seed = seed
        self.salt = salt
        self._prefix_words = {name: calibration.words_for(tokens, with_overhead=False)
                              for name, tokens in prefixes.items()}
        self._prefix_tokens = prefixes
        self._counts = counts or {}
        self._prefix_text: dict[tuple[str, int], str] = {}

    def prefix(self, group: str, idx: int) -> str:
        """The shared prefix request ``idx`` of ``group`` starts with: one of the group's
        ``count`` texts, chosen by the index and the seed (not the salt: the same each run)."""
        count = self._counts.get(group, 1)
        k = 0 if count == 1 else random.Random(hash_name(f"p:{idx}", self.seed)).randrange(count)
        text = self._prefix_text.get((group, k))
        if text is None:  # variant 0 keeps the text a one-prefix group always had
            name = group if k == 0 else f"{group}#{k}"
            text = self._prefix_text[(group, k)] = words(hash_name(name, self.seed),
                                                         self._prefix_words[group])
        return text

    def text(self, idx: int, input_tokens: int, prefix_group: str | None = None) -> str:
        body_tokens = float(input_tokens)
        head = ""
        if prefix_group is not None and prefix_group in self._prefix_words:
            head = self.prefix(prefix_group, idx) + "\n"
            body_tokens -= self._prefix_tokens[prefix_group]
        n = self.cal.words_for(body_tokens)
        return head + words(hash_name(f"{self.salt}:{idx}", self.seed), n)


def hash_name(name: str, seed: int) -> int:
    """A stable integer from a name (Python's str hash is salted per process)."""
    h = seed
    for ch in name.encode():
        h = (h * 131 + ch) % (2**61 - 1)
    return h
