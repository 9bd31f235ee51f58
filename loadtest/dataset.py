"""Real prompts for `sluice loadtest --dataset FILE`: read, count, filter, order, sample.

Two formats (docs/loadtest.md, "Real data"):

- JSONL, one object a line: ``{"prompt": "..."}`` or ``{"messages": [{"role", "content"}]}``,
  with an optional reference length ``output_tokens`` (or ``max_tokens``) or reference
  answer ``completion`` (or ``response``) whose token count becomes the length.
- ShareGPT JSON: ``[{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}]``.
  As vLLM's benchmark_serving does, the prompt is the first human turn and the output
  length that of the gpt turn answering it (found by role, not by position); a chat keeps
  a system turn that comes before it.

A file that is not JSON, or an entry of the wrong shape, is a ``DatasetError`` naming the
file and line (entry, for ShareGPT): a silently skipped line would change the traffic
without anyone knowing. Entries that are well-formed but unusable (an empty prompt or
answer, a conversation without a human turn answered by gpt) are dropped and counted, as
are those outside the length filters.

Which entries go out is fixed by the seed alone: the entries are visited in a permutation
drawn from ``default_rng([seed, 3])`` (``order: random``, or whenever ``sample`` is set)
or in file order, counted in that order, and the first ``sample`` that pass the filters are
kept (with ``order: sequential`` they are then put back in file order). Counting follows the
same order and stops once ``sample`` are kept, so a sample of a large file costs only its
own tokenize requests. Counts do not depend on timing, so the same seed, file and target
give the same entries in the same order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from loadtest.dataset_tokens import (
    Counter,
    Prompt,
    PromptRefused,
    TokenizerFileError,
    TokenizeUnavailable,
    make_counter,
)

_DATASET_STREAM = 3  # numpy stream id under the workload seed (arrivals.py uses 1 and 2)
_BATCH = 256  # entries counted per round (their requests still go 16 at a time)
DROP_REASONS = ("empty_prompt", "empty_answer", "too_few_turns", "no_answered_human_turn",
                "input_too_short", "input_too_long", "output_too_short", "output_too_long")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
                   "bard": "assistant", "model": "assistant", "system": "system"}


class DatasetError(ValueError):
    """The dataset is missing, not JSON, or has a bad entry; the message names the file and
    line (or entry): ``data.jsonl:12: 'messages' must be a non-empty list``."""


class DatasetSpec(BaseModel):
    """The workload's ``dataset:`` (or the CLI's ``--dataset`` flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    format: Literal["auto", "jsonl", "sharegpt"] = "auto"
    order: Literal["random", "sequential"] = "random"
    sample: int | None = Field(None, ge=1)
    min_input_tokens: int | None = Field(None, ge=1)
    max_input_tokens: int | None = Field(None, ge=1)
    min_output_tokens: int | None = Field(None, ge=1)
    max_output_tokens: int | None = Field(None, ge=1)
    tokenizer: str | None = None

    @model_validator(mode="after")
    def _ranges(self) -> DatasetSpec:
        for what in ("input", "output"):
            lo = getattr(self, f"min_{what}_tokens")
            hi = getattr(self, f"max_{what}_tokens")
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"min_{what}_tokens ({lo}) > max_{what}_tokens ({hi})")
        return self


@dataclass(slots=True, frozen=True)
class Entry:
    """One prompt ready to send: ``messages`` for api chat, ``prompt`` for completions
    (exactly one of them is set)."""

    messages: tuple[dict[str, Any], ...] | None
    prompt: str | None
    input_tokens: int  # as counted (exact when counted by the target)
    output_tokens: int | None  # the reference answer's length, when the entry has one
    exact: bool  # input_tokens counted by the target itself, not a local tokenizer


@dataclass(slots=True, frozen=True)
class _Item:
    """A usable entry before counting."""

    where: str  # "data.jsonl:12" or "data.json: entry 3"
    prompt: Prompt  # as the api sends it
    output_tokens: int | None  # given as a number
    answer: str | None  # reference answer text, to count when no number was given


# -- reading ---------------------------------------------------------------------------


def _text(obj: dict[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise DatasetError(f"{where}: {key!r} must be a string")
    return value


def _messages(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for k, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DatasetError(f"{where}: messages[{k}] needs a string 'role' and a string "
                               "'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def _as_api(messages: tuple[dict[str, Any], ...], api: str, where: str) -> Prompt:
    if api == "chat":
        return messages
    if len(messages) == 1 and messages[0]["role"] == "user":
        return str(messages[0]["content"])
    raise DatasetError(f"{where}: {len(messages)} messages cannot be a completions prompt; "
                       "use api: chat, or give this entry a 'prompt'")


def _jsonl_item(obj: Any, where: str, api: str) -> _Item | str:
    """The entry of one JSONL line, or the reason it is dropped."""
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if ("prompt" in obj) == ("messages" in obj):
        raise DatasetError(f"{where}: give exactly one of 'prompt' or 'messages'")
    numbers = [k for k in ("output_tokens", "max_tokens") if obj.get(k) is not None]
    texts = [k for k in ("completion", "response") if obj.get(k) is not None]
    if len(numbers) > 1 or len(texts) > 1:
        raise DatasetError(f"{where}: give one of {numbers or texts}, not both")
    output: int | None = None
    if numbers:
        output = obj[numbers[0]]
        if not isinstance(output, int) or isinstance(output, bool) or output < 1:
            raise DatasetError(f"{where}: {numbers[0]!r} must be an integer >= 1")
    answer = _text(obj, texts[0], where) if texts and output is None else None
    if "prompt" in obj:
        text = _text(obj, "prompt", where) or ""
        if not text.strip():
            return "empty_prompt"
        prompt: Prompt = ({"role": "user", "content": text},) if api == "chat" else text
    else:
        messages = _messages(obj["messages"], where)
        if not any(str(m["content"]).strip() for m in messages):
            return "empty_prompt"
        prompt = _as_api(messages, api, where)
    if answer is not None and not answer.strip():
        return "empty_answer"
    return _Item(where, prompt, output, answer)


def _read_jsonl(text: str, name: str, api: str) -> tuple[int, list[_Item], dict[str, int]]:
    items: list[_Item] = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    read = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise DatasetError(f"{where}: not JSON ({exc})") from None
        read += 1
        got = _jsonl_item(obj, where, api)
        if isinstance(got, str):
            dropped[got] += 1
        else:
            items.append(got)
    return read, items, dropped


def _sharegpt_item(obj: Any, where: str, api: str) -> _Item | str:
    if not isinstance(obj, dict) or not isinstance(obj.get("conversations"), list):
        raise DatasetError(f"{where}: expected an object with a 'conversations' list")
    if obj.get("id") is not None:
        where = f"{where} (id {obj['id']!r})"
    turns: list[tuple[str, str]] = []
    for k, turn in enumerate(obj["conversations"]):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str)
                and isinstance(turn.get("value"), str)):
            raise DatasetError(f"{where}: conversations[{k}] needs a string 'from' and a "
                               "string 'value'")
        role = _SHAREGPT_ROLES.get(turn["from"].lower())
        if role is None:
            raise DatasetError(f"{where}: conversations[{k}]: unknown 'from' "
                               f"{turn['from']!r} (human, gpt or system)")
        turns.append((role, turn["value"]))
    if len(turns) < 2:
        return "too_few_turns"
    human = next((k for k, (role, _) in enumerate(turns) if role == "user"), None)
    answer = None if human is None else next(
        (v for role, v in turns[human + 1:] if role == "assistant"), None)
    if human is None or answer is None:
        return "no_answered_human_turn"
    question = turns[human][1]
    if not question.strip():
        return "empty_prompt"
    if not answer.strip():
        return "empty_answer"
    if api != "chat":
        return _Item(where, question, None, answer)
    system = [{"role": "system", "content": v} for role, v in turns[:human] if role == "system"]
    return _Item(where, (*system[:1], {"role": "user", "content": question}), None, answer)


def _read_sharegpt(text: str, name: str, api: str) -> tuple[int, list[_Item], dict[str, int]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{name}:{exc.lineno}: not JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{name}: a ShareGPT file is a JSON array of conversations")
    items: list[_Item] = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    for k, obj in enumerate(data):
        got = _sharegpt_item(obj, f"{name}: entry {k}", api)
        if isinstance(got, str):
            dropped[got] += 1
        else:
            items.append(got)
    return len(data), items, dropped


def read_items(path: Path, name: str, fmt: str, api: str,
               ) -> tuple[str, int, list[_Item], dict[str, int]]:
    """(format, entries read, usable entries, dropped per reason) of a dataset file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError(f"{name}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{name}: cannot read it: {exc}") from None
    if fmt == "auto":
        fmt = "sharegpt" if text.lstrip().startswith("[") else "jsonl"
    reader = _read_sharegpt if fmt == "sharegpt" else _read_jsonl
    read, items, dropped = reader(text, name, api)
    if read == 0:
        raise DatasetError(f"{name}: no entries")
    return fmt, read, items, dropped


# -- counting, filtering, ordering -------------------------------------------------------


def _visit_order(n: int, spec: DatasetSpec, seed: int) -> list[int]:
    if spec.order == "sequential" and spec.sample is None:
        return list(range(n))
    rng = np.random.default_rng([seed, _DATASET_STREAM])
    return [int(i) for i in rng.permutation(n)]


def _verdict(spec: DatasetSpec, inp: int, out: int | None) -> str | None:
    """Why an entry of these lengths is dropped, or None. An entry without a reference
    length passes the output filters: its requests get the class's drawn length."""
    if spec.min_input_tokens is not None and inp < spec.min_input_tokens:
        return "input_too_short"
    if spec.max_input_tokens is not None and inp > spec.max_input_tokens:
        return "input_too_long"
    if out is not None and spec.min_output_tokens is not None and out < spec.min_output_tokens:
        return "output_too_short"
    if out is not None and spec.max_output_tokens is not None and out > spec.max_output_tokens:
        return "output_too_long"
    return None


def _refused(item: _Item, exc: PromptRefused) -> DatasetError:
    return DatasetError(f"{item.where}: the target refused to count it: {exc}")


async def _count_batch(counter: Counter, batch: list[_Item], spec: DatasetSpec,
                       ) -> list[tuple[int, int | None]]:
    """(input, output) tokens of each item; answers are counted only where the input
    passed its filters (the output of a dropped entry is never needed)."""
    try:
        inputs = await counter.count_prompts([it.prompt for it in batch])
    except PromptRefused as exc:
        raise _refused(batch[exc.index], exc) from None
    todo = [k for k, it in enumerate(batch)
            if it.answer is not None and _verdict(spec, inputs[k], None) is None]
    try:
        answers = await counter.count_answers([str(batch[k].answer) for k in todo])
    except PromptRefused as exc:
        raise _refused(batch[todo[exc.index]], exc) from None
    outputs: list[int | None] = [it.output_tokens for it in batch]
    for k, n in zip(todo, answers, strict=True):
        outputs[k] = n
    return list(zip(inputs, outputs, strict=True))


def _summary(values: list[int]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    return {"mean": round(float(a.mean()), 1), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99))}


async def prepare_dataset(spec: DatasetSpec, *, api: Literal["chat", "completions"], seed: int,
                          base_url: str, key: str | None, model: str,
                          base_dir: Path = Path("."),
                          ) -> tuple[list[Entry], dict[str, Any]]:
    """Read, count, filter, order and sample the entries. Returns (entries, info), info for
    details.json["dataset"]. Raises DatasetError for the file, RuntimeError when the target
    cannot count (unreachable, refuses the key)."""
    path = base_dir / spec.path
    fmt, read, items, dropped = read_items(path, spec.path, spec.format, api)
    tokenizer = None if spec.tokenizer is None else base_dir / spec.tokenizer
    order = _visit_order(len(items), spec, seed)
    want = len(items) if spec.sample is None else spec.sample
    kept: list[tuple[int, Entry]] = []
    counted = 0
    async with httpx.AsyncClient(timeout=60.0) as client:
        try:
            counter = await make_counter(client, api=api, tokenizer=tokenizer,
                                         base_url=base_url, key=key, model=model)
            while len(kept) < want and counted < len(order):
                # a sample usually needs few more than it keeps; the rest is read at once
                size = _BATCH if spec.sample is None else max(16, min(_BATCH, want - len(kept)))
                idxs = order[counted:counted + size]
                lengths = await _count_batch(counter, [items[i] for i in idxs], spec)
                for i, (inp, out) in zip(idxs, lengths, strict=True):
                    counted += 1
                    reason = _verdict(spec, inp, out)
                    if reason is not None:
                        dropped[reason] += 1
                        continue
                    p = items[i].prompt
                    entry = (Entry(None, p, inp, out, counter.exact) if isinstance(p, str)
                             else Entry(p, None, inp, out, counter.exact))
                    kept.append((i, entry))
                    if len(kept) == want:
                        break
        except TokenizerFileError as exc:
            raise DatasetError(f"dataset tokenizer: {exc}") from None
        except TokenizeUnavailable as exc:
            raise DatasetError(f"{exc}: cannot count the dataset's tokens there; pass "
                               "--tokenizer DIR (a directory with the model's tokenizer.json;"
                               " in YAML dataset.tokenizer)") from None
    if not kept:
        raise DatasetError(f"{spec.path}: no entry left ({read} read, dropped "
                           f"{ {k: v for k, v in dropped.items() if v} })")
    if spec.order == "sequential":
        kept.sort(key=lambda pair: pair[0])
    entries = [e for _, e in kept]
    outs = [e.output_tokens for e in entries if e.output_tokens is not None]
    info: dict[str, Any] = {
        "path": str(path.resolve()), "format": fmt, "order": spec.order, "seed": seed,
        "sample": spec.sample, "read": read, "usable": len(items), "counted": counted,
        "kept": len(entries), "dropped": dropped,
        "filters": {k: getattr(spec, k) for k in ("min_input_tokens", "max_input_tokens",
                                                    "min_output_tokens", "max_output_tokens")},
        "tokens_counted_by": counter.describe, "exact": counter.exact,
        "input_tokens": _summary([e.input_tokens for e in entries]),
        "output_tokens": _summary(outs), "with_output_tokens": len(outs),
    }
    return entries, info
