"""The inputs of ``backend.bench.grammar_libs`` and its JSON Schema coverage verdicts: the
vocabularies, the moderate schema the mask timings walk, and the feature probes.

A probe is a schema, instances that satisfy it and instances that violate it. Each
instance, as compact JSON, is driven token by token through the library's real matcher:
every token must be in the mask computed before it and be accepted, and the end token
must be allowed at the end. Verdicts: enforced; refused (compile error: its message and
the schema keywords it names); SILENTLY IGNORED (a violating instance was accepted: the
loosening issue #24 forbids); over-restrictive (a valid instance was refused); did not
finish (still compiling after the timeout); error. What a library logs to stderr while
judging a probe (C++ log lines no API returns) is kept as the probe's notes.

Vocabularies: ``1k`` is the tiny model's tokenizer; ``32k`` a byte-level BPE with the tiny
model's recipe, trained to 32000 tokens on this repository's .py/.md files and a seeded
sample of this interpreter's site-packages sources (no network), trained once and cached
under the Sluice cache per recipe and environment (another venv trains its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from modelfiles.tiny_model import IM_END, SPECIAL_TOKENS, default_cache_dir, train_tokenizer

if TYPE_CHECKING:
    from .grammar_libs import Adapter

    AdapterFactory = Callable[["BenchVocab", int], Adapter]

CORPUS_SEED = 20_240_917
CORPUS_BYTES = 96_000_000  # training text for the 32k tokenizer (15-80 s on 2 shared cores)
TOK32K_RECIPE = "sluice-bench-tok32k/1"  # bump when the recipe changes: it keys the cache
WORKER_SETUP_S = 300.0  # a coverage worker's imports and tokenizer, before its first probe
ENFORCED, REFUSED, IGNORED = "enforced", "refused", "SILENTLY IGNORED"
OVER, UNFINISHED, FAILED = "over-restrictive", "did not finish", "error"


@dataclass(slots=True, frozen=True)
class Probe:
    """One JSON Schema feature: its schema, valid instances, violating instances."""

    name: str
    schema: dict[str, Any]
    valid: tuple[Any, ...]
    invalid: tuple[Any, ...]


# An object of the kind a tool or extraction schema has: bounded string, integer range,
# enum, date-time, an array of closed objects, a nested object with a pattern.
MODERATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "banned"]},
        "created": {"type": "string", "format": "date-time"},
        "tags": {"type": "array", "maxItems": 5, "items": {
            "type": "object",
            "properties": {"key": {"type": "string"}, "weight": {"type": "number"}},
            "required": ["key", "weight"], "additionalProperties": False}},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "status", "created", "tags", "address"],
    "additionalProperties": False,
}
MODERATE_INSTANCE: dict[str, Any] = {
    "name": "Ada Lovelace", "age": 36, "status": "active", "created": "2024-05-17T09:30:00Z",
    "tags": [{"key": "math", "weight": 0.75}, {"key": "engine", "weight": 12}],
    "address": {"street": "12 St James's Square", "zip": "12345"},
}

_I = {"type": "integer"}
_EXTERNAL_REF = "https://example.com/s.json"
_IF_THEN_ELSE = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {}},
                 "required": ["k", "v"], "if": {"properties": {"k": {"const": "a"}}},
                 "then": {"properties": {"v": _I}},
                 "else": {"properties": {"v": {"type": "string"}}}}
_TREE = {"$defs": {"node": {"type": "object",
                            "properties": {"v": _I, "kids": {"type": "array",
                                                             "items": {"$ref": "#/$defs/node"}}},
                            "required": ["v"], "additionalProperties": False}},
         "$ref": "#/$defs/node"}


def _p(name: str, schema: dict[str, Any], valid: list[Any], invalid: list[Any]) -> Probe:
    return Probe(name, schema, tuple(valid), tuple(invalid))


PROBES: tuple[Probe, ...] = (
    _p("pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
       ["ABC-12"], ["abc-12", "ABCD-1"]),
    _p("format: date-time", {"type": "string", "format": "date-time"},
       ["2024-05-17T09:30:00Z"], ["yesterday", "2024-13-45"]),
    _p("format: date", {"type": "string", "format": "date"}, ["2024-05-17"], ["17/05/2024"]),
    _p("format: email", {"type": "string", "format": "email"},
       ["a.b@example.com"], ["not-an-email"]),
    _p("format: uri", {"type": "string", "format": "uri"},
       ["https://example.com/x?y=1"], ["not a uri"]),
    _p("format: uuid", {"type": "string", "format": "uuid"},
       ["123e4567-e89b-12d3-a456-426614174000"], ["1234"]),
    _p("format: ipv4", {"type": "string", "format": "ipv4"}, ["10.0.0.1"], ["hello"]),
    _p("format: hostname", {"type": "string", "format": "hostname"},
       ["example.com"], ["not a host!"]),
    _p("format: made-up", {"type": "string", "format": "made-up-format"}, ["x"], []),
    _p("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 4},
       ["abc"], ["a", "abcdef"]),
    _p("maxLength 5000 (size)", {"type": "string", "maxLength": 5000}, ["abc"], []),
    _p("minimum/maximum (integer)", {"type": "integer", "minimum": 1, "maximum": 10},
       [5, 10], [0, 11, 100]),
    _p("exclusiveMinimum/Maximum (integer)",
       {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, [5], [0, 10]),
    _p("minimum/maximum (number)", {"type": "number", "minimum": 0.5, "maximum": 2.5},
       [1.5], [3.0, 0.25]),
    _p("exclusiveMinimum (number)", {"type": "number", "exclusiveMinimum": 0}, [0.5], [0, -1]),
    _p("multipleOf", {"type": "integer", "multipleOf": 5}, [15], [7]),
    _p("enum", {"enum": ["red", "green", 3]}, ["red", 3], ["blue", 4]),
    _p("const", {"const": "fixed"}, ["fixed"], ["other"]),
    _p("type: [string, null]", {"type": ["string", "null"]}, ["x", None], [1]),
    _p("anyOf", {"anyOf": [_I, {"type": "string", "maxLength": 2}]}, [3, "ab"], ["abcd", True]),
    _p("oneOf (disjoint branches)", {"oneOf": [_I, {"type": "string"}]}, [3, "ab"], [True]),
    _p("oneOf (exclusivity)", {"oneOf": [{"type": "integer", "minimum": 0},
                                         {"type": "integer", "maximum": 10}]}, [20, -5], [5]),
    _p("allOf", {"allOf": [{"type": "object", "properties": {"a": _I}, "required": ["a"]},
                           {"type": "object", "properties": {"b": {"type": "string"}},
                            "required": ["b"]}]},
       [{"a": 1, "b": "x"}], [{"a": 1}, {"b": "x"}]),
    _p("$ref/$defs", {"$defs": {"pos": {"type": "integer", "minimum": 1}}, "type": "object",
                      "properties": {"n": {"$ref": "#/$defs/pos"}}, "required": ["n"],
                      "additionalProperties": False}, [{"n": 3}], [{"n": 0}]),
    _p("$ref recursive", _TREE, [{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}],
       [{"v": 1, "kids": [{"v": "x"}]}]),
    _p("$ref external URL", {"type": "object", "properties": {"a": {"$ref": _EXTERNAL_REF}},
                             "required": ["a"]},
       [{"a": 1}], [{"a": "anything"}, {"a": [1, {"z": None}]}]),
    _p("required", {"type": "object", "properties": {"a": _I, "b": _I}, "required": ["a", "b"]},
       [{"a": 1, "b": 2}], [{"a": 1}]),
    _p("additionalProperties: false",
       {"type": "object", "properties": {"a": _I}, "additionalProperties": False},
       [{"a": 1}], [{"a": 1, "b": 2}]),
    _p("additionalProperties: true",
       {"type": "object", "properties": {"a": _I}, "additionalProperties": True},
       [{"a": 1, "b": "x"}], [{"a": "x"}]),
    _p("additionalProperties omitted (default: allowed)",
       {"type": "object", "properties": {"a": _I}}, [{"a": 1, "b": 2}], [{"a": "x"}]),
    _p("additionalProperties: schema",
       {"type": "object", "properties": {"a": _I}, "additionalProperties": {"type": "string"}},
       [{"a": 1, "b": "x"}], [{"a": 1, "b": 2}]),
    _p("minItems/maxItems", {"type": "array", "items": _I, "minItems": 2, "maxItems": 3},
       [[1, 2], [1, 2, 3]], [[1], [1, 2, 3, 4]]),
    _p("uniqueItems", {"type": "array", "items": _I, "uniqueItems": True}, [[1, 2]], [[1, 1]]),
    _p("prefixItems + items: false",
       {"type": "array", "prefixItems": [{"type": "string"}, _I], "items": False},
       [["a", 1]], [[1, "a"], ["a", 1, 2]]),
    _p("items: false alone (empty array)", {"type": "array", "items": False}, [[]], [[1]]),
    _p("contains", {"type": "array", "items": _I, "contains": {"const": 5}}, [[1, 5]], [[1, 2]]),
    _p("minProperties/maxProperties", {"type": "object", "additionalProperties": _I,
                                       "minProperties": 1, "maxProperties": 2},
       [{"a": 1}], [{}, {"a": 1, "b": 2, "c": 3}]),
    _p("patternProperties", {"type": "object", "patternProperties": {"^x-": _I},
                             "additionalProperties": False}, [{"x-a": 1}], [{"x-a": "s"}, {"y": 1}]),
    _p("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                         "additionalProperties": _I}, [{"ab": 1}], [{"AB": 1}]),
    _p("not", {"type": "integer", "not": {"const": 3}}, [4], [3]),
    _p("if/then/else", _IF_THEN_ELSE, [{"k": "a", "v": 1}, {"k": "b", "v": "s"}],
       [{"k": "a", "v": "s"}]),
    _p("dependentRequired", {"type": "object", "properties": {"a": _I, "b": _I},
                             "dependentRequired": {"a": ["b"]}}, [{"a": 1, "b": 2}, {"b": 2}],
       [{"a": 1}]),
    _p("dependentSchemas", {"type": "object", "properties": {"a": _I, "b": _I},
                            "dependentSchemas": {"a": {"required": ["b"]}}},
       [{"a": 1, "b": 2}], [{"a": 1}]),
    _p("unevaluatedProperties: false",
       {"type": "object", "properties": {"a": _I}, "unevaluatedProperties": False},
       [{"a": 1}], [{"a": 1, "b": 2}]),
    _p("unevaluatedProperties: false + additionalProperties: true",
       {"type": "object", "properties": {"a": _I}, "additionalProperties": True,
        "unevaluatedProperties": False}, [{"a": 1}], [{"a": 1, "b": 2}]),
    _p("unknown keyword (x-custom)", {"type": "integer", "x-custom": 1}, [1], ["s"]),
    _p("pattern unanchored", {"type": "string", "pattern": "[0-9]"}, ["a1b"], ["abc"]),
    _p("pattern with lookahead", {"type": "string", "pattern": "^(?!foo)[a-z]+$"},
       ["bar"], ["foo"]),
    _p("pattern with backreference", {"type": "string", "pattern": "^(a|b)\\1$"}, ["aa"], ["ab"]),
    _p("OpenAI strict tool arguments",
       {"type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"type": ["string", "null"],
                                                  "enum": ["c", "f", None]}},
        "required": ["city", "unit"], "additionalProperties": False},
       [{"city": "Oslo", "unit": None}, {"city": "Oslo", "unit": "c"}],
       [{"city": "Oslo"}, {"city": "Oslo", "unit": "k"}]),
)


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


@dataclass(slots=True, frozen=True)
class BenchVocab:
    """A tokenizer as every library gets it: tokenizer.json text, size, end token."""

    name: str
    tokenizer_json: str
    size: int
    eos_id: int
    source: str

    def encoder(self) -> tokenizers.Tokenizer:
        return tokenizers.Tokenizer.from_str(self.tokenizer_json)

    def encode(self, value: Any, encoder: tokenizers.Tokenizer) -> list[int]:
        ids: list[int] = encoder.encode(compact(value), add_special_tokens=False).ids
        return ids


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted (a byte-level BPE token's text
    back to its bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _source_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        found += [Path(folder, f) for f in sorted(files) if f.endswith(suffixes)]
    return found


def _corpus() -> list[Path]:
    """This repository's .py/.md files, then a seeded sample of site-packages sources: up
    to CORPUS_BYTES of UTF-8 text."""
    own = _source_files(Path(__file__).resolve().parents[2], (".py", ".md"))
    site = _source_files(Path(sysconfig.get_paths()["purelib"]), (".py",))
    random.Random(CORPUS_SEED).shuffle(site)
    files, total = [], 0
    for path in own + site:
        data = path.read_bytes()
        if total + len(data) > CORPUS_BYTES:
            break
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
        total += len(data)
    return files


def _tokenizer_32k() -> tuple[tokenizers.Tokenizer, str]:
    """Trained once per recipe and environment, then read from the cache. Not keyed by the
    text itself: the repository changes with every edit, and a 32k BPE takes a minute or
    more to train (delete the file to retrain)."""
    purelib = sysconfig.get_paths()["purelib"]
    key = f"{TOK32K_RECIPE}\0{CORPUS_SEED}\0{CORPUS_BYTES}\0{purelib}".encode()
    path = default_cache_dir() / "bench" / f"tok32k-{hashlib.sha256(key).hexdigest()[:16]}.json"
    about = (f"byte-level BPE trained on this repository's .py/.md + {purelib} sources, "
             f"seed {CORPUS_SEED}, cached at {path}")
    if path.is_file():
        return tokenizers.Tokenizer.from_file(str(path)), about
    tok = tokenizers.Tokenizer(models.BPE())  # modelfiles.tiny_model's recipe, 32000 tokens
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in _corpus()], trainers.BpeTrainer(
        vocab_size=32000, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tok.save(str(partial))
    os.replace(partial, path)  # atomic: a concurrent run sees all of it or none
    return tok, about


def load_vocab(name: str) -> BenchVocab:
    if name == "1k":
        tok, about = train_tokenizer(), "the tiny model's byte-level BPE (modelfiles.tiny_model)"
    else:
        tok, about = _tokenizer_32k()
    eos = tok.token_to_id(IM_END)
    if eos is None:
        raise RuntimeError(f"the {name} tokenizer has no {IM_END}")
    return BenchVocab(name, tok.to_str(), tok.get_vocab_size(), eos, about)


_NAME_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_NAMED_BY_VALUE = {"pattern", "format", "$ref"}  # errors quote these keywords' values


def _keywords(schema: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(schema, dict):
        for key, value in schema.items():
            yield key, value
            inner = value.values() if key in _NAME_MAPS and isinstance(value, dict) else [value]
            for sub in inner:
                yield from _keywords(sub)
    elif isinstance(schema, list):
        for item in schema:
            yield from _keywords(item)


def named_keywords(schema: dict[str, Any], message: str) -> list[str]:
    """The schema's keywords that ``message`` names: by name, or for a pattern, a format or a
    $ref, by quoting its value."""
    named: list[str] = []
    for key, value in _keywords(schema):
        by_name = re.search(rf"(?<![\w$]){re.escape(key)}(?!\w)", message) is not None
        by_value = key in _NAMED_BY_VALUE and isinstance(value, str) and value in message
        if (by_name or by_value) and key not in named:
            named.append(key)
    return named


# ---------------------------------------------------------------- judging a library
def bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.zeros((rows, (vocab_size + 31) // 32), dtype=torch.int32)


def allowed(mask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(mask[row, token >> 5]) >> (token & 31)) & 1)


def accepts(adapter: Adapter, matcher: Any, ids: list[int], eos: int, mask: torch.Tensor) -> bool:
    """Whether ``matcher`` takes ``ids``, each from its mask, then allows and takes the end."""
    for token in ids:
        adapter.fill(matcher, mask, 0)
        if not allowed(mask, 0, token) or not adapter.accept(matcher, token):
            return False
    adapter.fill(matcher, mask, 0)
    return allowed(mask, 0, eos) and adapter.accepts_end(matcher)


@contextlib.contextmanager
def _stderr_into(lines: list[str]) -> Iterator[None]:
    """Capture file descriptor 2 (where C++ libraries log) for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines += [x for x in sink.read().decode(errors="replace").splitlines() if x]


def probe_verdict(adapter: Adapter, vocab: BenchVocab, encoder: tokenizers.Tokenizer,
                  probe: Probe) -> dict[str, Any]:
    began, notes, mask = time.perf_counter(), list[str](), bitmask(1, vocab.size)
    with _stderr_into(notes), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled = adapter.compile(probe.schema)
            adapter.matcher(compiled)  # llguidance builds lazily: errors can surface here
        except Exception as exc:  # noqa: BLE001 - any compile error is the library refusing
            message = f"{type(exc).__name__}: {exc}"
            verdict = {"verdict": REFUSED, "message": message,
                       "keywords": named_keywords(probe.schema, message)}
        else:
            def taken(value: Any) -> bool:
                matcher = adapter.matcher(compiled)
                return accepts(adapter, matcher, vocab.encode(value, encoder), vocab.eos_id, mask)
            try:
                bad = [compact(v) for v in probe.invalid if taken(v)]
                good = [compact(v) for v in probe.valid if not taken(v)]
                verdict = {"verdict": IGNORED if bad else OVER if good else ENFORCED,
                           "accepted_invalid": bad, "refused_valid": good}
            except Exception as exc:  # noqa: BLE001 - reported in the table, not raised
                verdict = {"verdict": FAILED, "message": f"{type(exc).__name__}: {exc}"}
    notes += [str(w.message) for w in caught]
    return {**verdict, "notes": notes, "seconds": round(time.perf_counter() - began, 4)}


def _coverage_worker(make: AdapterFactory, vocab: BenchVocab, todo: list[int],
                     out: multiprocessing.connection.Connection) -> None:
    adapter, encoder = make(vocab, 1), vocab.encoder()
    out.send("ready")
    for index in todo:  # in order: the parent knows which probe a silence belongs to
        out.send((index, probe_verdict(adapter, vocab, encoder, PROBES[index])))


def coverage(name: str, make: AdapterFactory, vocab: BenchVocab, timeout: float
             ) -> list[dict[str, Any]]:
    """Every probe's verdict for one library, from spawned workers (a new one after each
    probe that did not finish or killed its worker). A worker, not a thread: outlines-core's
    index build for some schemas runs for minutes and cannot be interrupted in-process."""
    spawn = multiprocessing.get_context("spawn")
    results: dict[int, dict[str, Any]] = {}
    todo = list(range(len(PROBES)))
    while todo:
        receive, send = spawn.Pipe(duplex=False)
        worker = spawn.Process(target=_coverage_worker, args=(make, vocab, todo, send),
                               daemon=True)
        worker.start()
        send.close()
        started = False
        try:
            started = receive.poll(WORKER_SETUP_S) and receive.recv() == "ready"
            while started and todo:
                if not receive.poll(timeout):
                    results[todo.pop(0)] = {"verdict": UNFINISHED, "notes": [],
                                            "message": f"still compiling after {timeout:g} s"}
                    break
                index, verdict = receive.recv()
                results[index] = verdict
                todo.remove(index)
        except EOFError:  # the worker died: in the library on its probe, or while starting
            if started:
                results[todo.pop(0)] = {"verdict": FAILED, "notes": [],
                                        "message": f"the worker died ({worker.exitcode})"}
        finally:
            receive.close()
            worker.kill()  # ours, by its handle: done or stuck, it goes
            worker.join()
        if not started:  # its imports or tokenizer failed: every probe would fail the same
            raise RuntimeError(f"{name}: the coverage worker did not start ({worker.exitcode})")
    return [results[i] for i in range(len(PROBES))]
