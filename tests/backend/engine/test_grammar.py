"""Constrained decoding in the engine (grammar.py, grammar_masks.py) with the random-weight
tiny model: only a real constraint makes random weights emit valid JSON.

Every output of a hypothesis-generated schema validates (jsonschema); schemas with what the
grammar library cannot enforce are refused naming every keyword; n > 1 choices, preemption
and aborts keep the grammar state right and leave no matcher or KV block behind;
unconstrained steps start no mask work; constrained sequences never speculate."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.engine import LLMEngine
from backend.engine.errors import InvalidRequestError
from backend.engine.grammar import GrammarCompiler
from backend.engine.grammar_masks import Masker
from backend.engine.sampling import GrammarSpec, SamplingParams

from .schemas import closing_bias, satisfiable, schemas

PROMPT_TEXT = "<|im_start|>user\nreply in JSON<|im_end|>\n<|im_start|>assistant\n"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def make(cache: Path, **kw: Any) -> EngineParts:
    base: dict[str, Any] = {
        "model": "tiny", "cache_dir": str(cache), "device": "cpu", "dtype": "float32",
        "block_size": 4, "kv_blocks": 512, "max_num_seqs": 16,
        "max_num_batched_tokens": 64}
    base.update(kw)
    return build_engine(EngineConfig(**base))


@pytest.fixture(scope="module")
def parts(tiny_cache_dir: Path) -> EngineParts:
    return make(tiny_cache_dir)


def spec(schema: Any) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def drain(core: LLMEngine) -> dict[tuple[str, int], tuple[str, str | None]]:
    """Run until idle: (text, finish reason) per (request, choice)."""
    texts: dict[tuple[str, int], list[str]] = {}
    reasons: dict[tuple[str, int], str | None] = {}
    for _ in range(100_000):
        if not core.has_work():
            break
        for d in core.step():
            texts.setdefault((d.request_id, d.index), []).append(d.text)
            if d.finish_reason is not None:
                reasons[(d.request_id, d.index)] = d.finish_reason
    assert not core.has_work()
    return {k: ("".join(v), reasons.get(k)) for k, v in texts.items()}


def assert_clean(core: LLMEngine) -> None:
    state = core.state()
    assert state.grammar_sequences == 0
    assert state.kv_blocks_free == state.kv_blocks_total
    core.block_manager.check_invariants()


# ---- the compiler -------------------------------------------------------------------------
def test_refusal_names_every_unenforceable_keyword(parts: EngineParts) -> None:
    compiler = parts.core.grammars
    assert compiler is not None
    schema = {"type": "array", "uniqueItems": True, "items": {"not": {"type": "null"}}}
    with pytest.raises(InvalidRequestError) as info:
        compiler.check(spec(schema))
    assert info.value.param == "response_format"
    assert "uniqueItems" in str(info.value) and '"not"' in str(info.value)


@pytest.mark.parametrize("schema, word", [
    ({"type": "intger"}, "intger"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    ({"type": "string", "format": "made-up"}, "made-up"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
     "example.com"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if"),
])
def test_bad_or_unenforceable_schemas_are_refused(parts: EngineParts, schema: Any,
                                                  word: str) -> None:
    assert parts.core.grammars is not None
    with pytest.raises(InvalidRequestError) as info:
        parts.core.grammars.check(GrammarSpec("json_schema", json.dumps(schema), "tools"))
    assert info.value.param == "tools" and word in str(info.value)


def test_compiled_once_per_grammar_then_copied(parts: EngineParts) -> None:
    g = GrammarCompiler.for_tokenizer(parts.tokenizer, parts.model_config.vocab_size)
    a, b = spec({"type": "object"}), spec({"type": "array"})
    m1, m2, m3 = g.matcher(a), g.matcher(a), g.matcher(b)
    assert (g.stats.compiles, g.stats.cache_hits) == (2, 1)
    assert len(g.stats.compile_seconds) == 2 and g.stats.hit_rate == pytest.approx(1 / 3)
    assert m1 is not m2
    assert m1.consume_token(parts.tokenizer.encode("{")[-1]) and not m2.is_error()
    assert m2.compute_bitmask() != m1.compute_bitmask()  # copies hold their own state
    assert m3.compute_bitmask() == g.matcher(b).compute_bitmask()


def test_the_cache_is_bounded(parts: EngineParts) -> None:
    g = GrammarCompiler(parts.tokenizer.backend.to_str(), parts.model_config.vocab_size,
                        parts.tokenizer.eos_token_ids[0], cache_size=3)
    for i in range(10):
        g.check(spec({"type": "integer", "minimum": i}))
    assert len(g._cache) == 3
    g.check(spec({"type": "integer", "minimum": 9}))
    assert g.stats.cache_hits == 1


def test_lark_grammars(parts: EngineParts) -> None:
    assert parts.core.grammars is not None
    lark = 'start: "<call>" %json{"type": "object", "properties": {"x": {"type": "integer"}},' \
           ' "required": ["x"], "additionalProperties": false} "</call>"'
    core = parts.core
    prompt = parts.tokenizer.encode(PROMPT_TEXT)
    core.add_request("lark", prompt, SamplingParams(
        max_tokens=300, temperature=0.0, grammar=GrammarSpec("lark", lark, "tools"),
        logit_bias=closing_bias(parts.tokenizer)))
    (text, reason), = drain(core).values()
    assert reason == "stop" and text.startswith("<call>") and text.endswith("</call>")
    assert isinstance(json.loads(text[6:-7])["x"], int)
    with pytest.raises(InvalidRequestError):
        parts.core.grammars.check(GrammarSpec("lark", "start: undefined_rule", "tools"))


# ---- the engine -------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schema=schemas, greedy=st.booleans(), seed=st.integers(0, 2**16))
def test_every_output_validates(parts: EngineParts, schema: dict[str, Any], greedy: bool,
                                seed: int) -> None:
    core, tok = parts.core, parts.tokenizer
    params = SamplingParams(max_tokens=600, temperature=0.0 if greedy else 1.0, seed=seed,
                            grammar=spec(schema), logit_bias=closing_bias(tok))
    try:
        core.add_request("h", tok.encode(PROMPT_TEXT), params)
    except InvalidRequestError:
        # only a schema that no instance satisfies may be refused (the strategy uses
        # nothing the library cannot enforce)
        assert not satisfiable(schema), schema
        return
    (text, reason), = drain(core).values()
    assert reason == "stop", (schema, text)
    jsonschema.validate(json.loads(text), schema)
    assert_clean(core)


def test_without_the_grammar_the_same_model_emits_no_json(parts: EngineParts) -> None:
    """The control: the bias alone does not make JSON, the grammar does."""
    core, tok = parts.core, parts.tokenizer
    for i in range(4):
        core.add_request(f"free{i}", tok.encode(PROMPT_TEXT), SamplingParams(
            max_tokens=40, temperature=1.0, seed=i, logit_bias=closing_bias(tok)))
    for text, _ in drain(core).values():
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(text), PERSON)


def test_choices_and_a_batch_of_mixed_requests(parts: EngineParts) -> None:
    core, tok = parts.core, parts.tokenizer
    prompt = tok.encode(PROMPT_TEXT)
    bias = closing_bias(tok)
    core.add_request("n3", prompt, SamplingParams(max_tokens=200, n=3, seed=1,
                                                  grammar=spec(PERSON), logit_bias=bias))
    core.add_request("free", prompt, SamplingParams(max_tokens=30, temperature=0.0))
    core.add_request("obj", prompt, SamplingParams(max_tokens=200, temperature=0.0,
                                                   grammar=spec({"type": "object"})))
    out = drain(core)
    assert len(out) == 5
    for i in range(3):
        text, reason = out[("n3", i)]
        assert reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)
    assert isinstance(json.loads(out[("obj", 0)][0]), dict)
    assert len({out[("n3", i)][0] for i in range(3)}) > 1  # each choice its own state
    assert_clean(core)


def test_an_abort_frees_the_grammar_state_and_the_blocks(parts: EngineParts) -> None:
    core, tok = parts.core, parts.tokenizer
    core.add_request("ab", tok.encode(PROMPT_TEXT),
                     SamplingParams(max_tokens=500, n=2, grammar=spec({"type": "string"})))
    core.add_request("waiting", tok.encode(PROMPT_TEXT),
                     SamplingParams(max_tokens=500, grammar=spec({"type": "string"})))
    for _ in range(3):
        core.step()
    assert core.state().grammar_sequences == 3
    core.abort("ab")
    assert core.state().grammar_sequences == 1
    core.abort("waiting")
    assert_clean(core)


def test_preemption_keeps_the_grammar_state(tiny_cache_dir: Path) -> None:
    """A preempted constrained sequence is recomputed; its matcher is not replayed."""
    parts = make(tiny_cache_dir, kv_blocks=40)  # 160 slots for 6 long-prompt requests
    core, tok = parts.core, parts.tokenizer
    rng = random.Random(3)
    bias = closing_bias(tok)
    for i in range(6):
        prompt = [rng.randrange(4, 1000) for _ in range(rng.randint(20, 40))]
        core.add_request(f"p{i}", prompt, SamplingParams(
            max_tokens=60, temperature=1.0, seed=i, logit_bias=bias, grammar=spec(PERSON)))
    out = drain(core)
    assert core.scheduler.num_preemptions > 0
    for text, reason in out.values():
        if reason == "stop":
            jsonschema.validate(json.loads(text), PERSON)
        else:
            assert reason == "length"
    assert sum(r == "stop" for _, r in out.values()) >= 3
    assert_clean(core)


def test_unconstrained_steps_start_no_mask_work(parts: EngineParts,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    starts: list[int] = []
    original = Masker.start

    def counting(self: Masker, work: Any, wants_raw: bool = False) -> Any:
        starts.append(len(work))
        return original(self, work, wants_raw)

    monkeypatch.setattr(Masker, "start", counting)
    core, tok = parts.core, parts.tokenizer
    core.add_request("plain", tok.encode(PROMPT_TEXT), SamplingParams(max_tokens=20))
    drain(core)
    assert starts == []
    core.add_request("plain2", tok.encode(PROMPT_TEXT), SamplingParams(max_tokens=20,
                                                                       ignore_eos=True))
    core.add_request("json", tok.encode(PROMPT_TEXT), SamplingParams(
        max_tokens=200, grammar=spec({"type": "object"})))
    drain(core)
    assert starts and set(starts) == {1}  # only the constrained row, never the other


def test_constrained_sequences_never_speculate(tiny_cache_dir: Path) -> None:
    parts = make(tiny_cache_dir, speculative="ngram", speculative_max_batch=16)
    core, tok = parts.core, parts.tokenizer
    motif = tok.encode(" the cat sat on the mat")
    prompt = (motif * 10)[:60]
    core.add_request("free", prompt, SamplingParams(max_tokens=40, temperature=0.0,
                                                    ignore_eos=True))
    core.add_request("json", prompt, SamplingParams(
        max_tokens=200, temperature=0.0, grammar=spec(PERSON),
        logit_bias=closing_bias(tok)))
    drafted: set[str] = set()
    schedule = core.scheduler.schedule

    def watching():  # type: ignore[no-untyped-def]
        out = schedule()
        drafted.update(c.seq.request_id for c in out.chunks if c.num_spec)
        return out

    core.scheduler.schedule = watching  # type: ignore[method-assign]
    out = drain(core)
    assert "free" in drafted and "json" not in drafted
    jsonschema.validate(json.loads(out[("json", 0)][0]), PERSON)
    assert_clean(core)


def test_ignore_eos_cannot_be_combined_with_a_grammar() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(ignore_eos=True, grammar=spec({"type": "object"}))
    assert info.value.param == "ignore_eos"


def test_logprobs_are_the_models_not_the_masks(parts: EngineParts) -> None:
    """As without a grammar (vLLM's default), logprobs read the raw logits: the first
    token's top logprobs are those of the same request unconstrained."""
    core, tok = parts.core, parts.tokenizer
    firsts = {}
    for rid, grammar in (("free", None), ("json", spec(PERSON))):
        core.add_request(rid, tok.encode(PROMPT_TEXT), SamplingParams(
            max_tokens=3, temperature=0.0, logprobs=5, grammar=grammar))
        for _ in range(50):
            deltas = core.step()
            if deltas:
                assert deltas[0].logprobs is not None
                firsts[rid] = deltas[0].logprobs[0]
                break
        drain(core)
    assert firsts["json"].top == firsts["free"].top
    assert all(lp > float("-inf") for _, lp in firsts["json"].top)
    assert tok.decode([firsts["free"].top[0][0]]) != "{"  # the mask forced another token
    assert firsts["json"].logprob < firsts["free"].logprob
    assert_clean(core)


# ---- grammars compile outside the batch ----------------------------------------------------
class SlowCompile:
    """Holds ``GrammarCompiler.compile`` in its worker thread until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        original = GrammarCompiler.compile

        def held(compiler: GrammarCompiler, spec: GrammarSpec) -> Any:
            if threading.current_thread() is not threading.main_thread():
                self.entered.set()
                assert self.gate.wait(30)
            return original(compiler, spec)

        monkeypatch.setattr(GrammarCompiler, "compile", held)


def test_a_new_grammar_compiles_while_the_batch_runs(parts: EngineParts,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    core, tok = parts.core, parts.tokenizer
    slow = SlowCompile(monkeypatch)
    schema = {"type": "object", "properties": {"compiled_late": {"type": "boolean"}},
              "required": ["compiled_late"], "additionalProperties": False}
    core.add_request("free", tok.encode(PROMPT_TEXT), SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True))
    core.add_request("late", tok.encode(PROMPT_TEXT), SamplingParams(
        max_tokens=50, temperature=0.0, grammar=spec(schema)))
    assert slow.entered.wait(30)
    produced = 0
    for _ in range(8):  # the running request keeps stepping; the other waits outside
        produced += sum(len(d.token_ids) for d in core.step() if d.request_id == "free")
        assert core.scheduler.get("late") is None and core.state().waiting == 1
    assert produced == 8 and core.has_work()
    slow.gate.set()
    (text, reason), = drain(core).values()
    assert reason == "stop" and json.loads(text)["compiled_late"] in (True, False)
    assert core.grammars is not None and core.grammars.ready(spec(schema))
    assert_clean(core)


def test_an_abort_while_compiling_ends_the_request(parts: EngineParts,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    core, tok = parts.core, parts.tokenizer
    slow = SlowCompile(monkeypatch)
    schema = {"type": "array", "items": {"const": "aborted while compiling"}}
    core.add_request("gone", tok.encode(PROMPT_TEXT),
                     SamplingParams(max_tokens=20, grammar=spec(schema)))
    assert slow.entered.wait(30) and core.has_work()
    final = core.abort("gone")
    assert final is not None and final.finished and final.finish_reason == "abort"
    assert not core.has_work() and core.state().waiting == 0
    slow.gate.set()
    core.add_request("after", tok.encode(PROMPT_TEXT), SamplingParams(max_tokens=3))
    out = drain(core)
    assert list(out) == [("after", 0)] and core.take_refusals() == []
    assert_clean(core)


def test_a_grammar_that_fails_to_compile_late_is_refused(parts: EngineParts,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The server checks every grammar first; should the engine's compile still fail, the
    request is refused (the transport tells its stream), and nothing is left behind."""
    core, tok = parts.core, parts.tokenizer

    def failing(compiler: GrammarCompiler, spec: GrammarSpec) -> Any:
        raise InvalidRequestError("no", spec.param)

    monkeypatch.setattr(GrammarCompiler, "compile", failing)
    monkeypatch.setattr(GrammarCompiler, "ready", lambda compiler, spec: False)
    core.add_request("bad", tok.encode(PROMPT_TEXT),
                     SamplingParams(max_tokens=5, grammar=spec({"type": "null"})))
    for _ in range(100):
        core.step()
        refused = core.take_refusals()
        if refused:
            break
    assert [(rid, e.param) for rid, e in refused] == [("bad", "response_format")]
    assert not core.has_work()
    assert_clean(core)


def test_a_schema_without_finite_output_is_refused_by_the_check(parts: EngineParts) -> None:
    assert parts.core.grammars is not None
    with pytest.raises(InvalidRequestError) as info:
        parts.core.grammars.check(spec({"$ref": "#"}))
    assert "admits no output" in str(info.value) and len(str(info.value)) < 200
