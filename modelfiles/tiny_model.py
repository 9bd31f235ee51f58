"""The deterministic default checkpoint: a tiny random Llama in standard Hugging Face layout.

`write_tiny_model(dir)` produces the same bytes on every run and machine:

* tokenizer.json: byte-level BPE trained by `tokenizers`' BpeTrainer on data/corpus.txt (the
  trainer is deterministic: merge ties break on the pair, not on hash order; tested);
* model.safetensors: float32 weights from numpy's PCG64 with a fixed seed (numpy's generator
  streams are platform-independent; torch's RNG is not used);
* JSON files with sorted keys, fixed separators and no timestamps.

The weights are random, so the text is nonsense, but greedy decoding is varied (not one repeated
token) and top logits are well separated, which makes engine-vs-reference comparisons stable.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from safetensors.numpy import save as save_safetensors
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

TINY_MODEL_NAME = "sluice-tiny"
# Bump whenever any output byte changes; it names the cache directory.
GENERATOR_VERSION = "2"  # 2: the chat template renders tools
SEED = 20_240_917

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Trainer special tokens take ids 0..3 in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)

BPE_VOCAB_SIZE = 1024
MAX_POSITIONS = 2048


@dataclass(slots=True, frozen=True)
class Shape:
    """The Llama shapes of a generated checkpoint, and the seed of its weights."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seed: int
    # Write only the first this-many of the drawn layers (None: all): a draft model for
    # speculative decoding that is the default model cut short, the same draws otherwise.
    kept_layers: int | None = None

    @property
    def written_layers(self) -> int:
        return self.layers if self.kept_layers is None else self.kept_layers

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# The default model. `small` (~10M parameters) is the same tokenizer and template with
# shapes that make a CPU decode step cost milliseconds, so that under load the model, not
# Python or HTTP, saturates first (`make capacity`).
# `tiny-draft` is `tiny`'s first layer with its embedding, final norm and head: a draft
# model for `sluice backend --speculative draft:DIR` in front of the default model.
SIZES = {"tiny": Shape(64, 176, 4, 4, 2, SEED), "small": Shape(384, 1024, 6, 6, 2, 7),
         "tiny-draft": Shape(64, 176, 4, 4, 2, SEED, kept_layers=1)}
TINY = SIZES["tiny"]
# The lm_head is drawn wider than 1/sqrt(fan_in) so that logits spread over several units and
# the argmax is rarely a near-tie.
LM_HEAD_GAIN = 4.0

# Tools (OpenAI's `tools`) are listed in the system turn, Hermes / Qwen style; an assistant's
# `tool_calls` are written as the model is constrained to write them (protocol/tool_calls.py:
# `<tool_call>\n{"name": "NAME", "arguments": {...}}\n</tool_call>`, "\n" between calls),
# and tool results (role "tool") as `<tool_response>` blocks of one user turn. Chats without
# tools render exactly as before tools were supported.
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] + '\\n\\n' }}
{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
{{- raise_exception('Unsupported role: ' + message['role']) }}
{%- endif %}
{%- if message['role'] == 'system' and not loop.first %}
{{- raise_exception('The system message must come first') }}
{%- endif %}
{%- if message['role'] == 'system' and tools %}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or loop.previtem['role'] != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem['role'] != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined %}
{{- '<|im_start|>assistant\\n' }}
{%- if message['content'] %}
{{- message['content'] + '\\n' }}
{%- endif %}
{%- for call in message['tool_calls'] %}
{%- set fn = call['function'] if call['function'] is defined else call %}
{%- if not loop.first %}
{{- '\\n' }}
{%- endif %}
{{- '<tool_call>\\n{"name": ' + (fn['name'] | tojson) + ', "arguments": ' }}
{%- if fn['arguments'] is string %}
{{- fn['arguments'] }}
{%- else %}
{{- fn['arguments'] | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _corpus_text() -> str:
    resource = importlib.resources.files("modelfiles").joinpath("data/corpus.txt")
    return resource.read_text(encoding="utf-8")


def generator_hash() -> str:
    """12 hex naming this generator's output: its version, the corpus and the template."""
    digest = hashlib.sha256(f"sluice-tiny-generator/{GENERATOR_VERSION}\n".encode())
    digest.update(hashlib.sha256(_corpus_text().encode("utf-8")).digest())
    digest.update(hashlib.sha256(CHAT_TEMPLATE.encode("utf-8")).digest())
    return digest.hexdigest()[:12]


def _json_bytes(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, separators=(",", ": ")) + "\n").encode()


def train_tokenizer(corpus: str | None = None) -> tokenizers.Tokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenizer) whose post-processor prepends BOS."""
    text = _corpus_text() if corpus is None else corpus
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _padded_vocab(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def _model_config(vocab_size: int, ids: dict[str, int], shape: Shape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.written_layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[IM_END], ids[EOS_TOKEN]],
        "pad_token_id": ids[EOS_TOKEN],
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _weights(vocab_size: int, shape: Shape) -> dict[str, np.ndarray]:
    """Seeded weights, drawn in one fixed key order from a single PCG64 stream."""
    rng = np.random.Generator(np.random.PCG64(shape.seed))

    def normal(shape: tuple[int, int], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> np.ndarray:
        return normal((out_features, in_features), gain / float(np.sqrt(in_features)))

    h, kv, q = shape.hidden, shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim
    inter = shape.intermediate
    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal((vocab_size, h), 1.0)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[p + "self_attn.q_proj.weight"] = linear(q, h)
        tensors[p + "self_attn.k_proj.weight"] = linear(kv, h)
        tensors[p + "self_attn.v_proj.weight"] = linear(kv, h)
        tensors[p + "self_attn.o_proj.weight"] = linear(h, q)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[p + "mlp.gate_proj.weight"] = linear(inter, h)
        tensors[p + "mlp.up_proj.weight"] = linear(inter, h)
        tensors[p + "mlp.down_proj.weight"] = linear(h, inter)
    for i in range(shape.written_layers, shape.layers):  # drawn, not written
        for name in [n for n in tensors if n.startswith(f"model.layers.{i}.")]:
            del tensors[name]
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    tensors["lm_head.weight"] = linear(vocab_size, h, gain=LM_HEAD_GAIN)
    return tensors


def write_tiny_model(out_dir: Path, shape: Shape = TINY) -> Path:
    """Write the tiny checkpoint (or another ``SIZES`` entry) into out_dir (created if
    needed); returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    found = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    # Invariant: the trainer puts special tokens first, so ids are stable across corpora.
    if [found[t] for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"unexpected special token ids: {found}")
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab_size = _padded_vocab(tok.get_vocab_size(with_added_tokens=True))

    files: dict[str, bytes] = {
        "config.json": _json_bytes(_model_config(vocab_size, ids, shape)),
        "generation_config.json": _json_bytes({
            "bos_token_id": ids[BOS_TOKEN],
            "eos_token_id": [ids[IM_END], ids[EOS_TOKEN]],
            "pad_token_id": ids[EOS_TOKEN],
            "do_sample": False,
        }),
        "tokenizer.json": (tok.to_str(pretty=True) + "\n").encode("utf-8"),
        "tokenizer_config.json": _json_bytes({
            "bos_token": BOS_TOKEN,
            "eos_token": IM_END,
            "pad_token": EOS_TOKEN,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }),
        "chat_template.jinja": CHAT_TEMPLATE.encode("utf-8"),
        "model.safetensors": save_safetensors(_weights(vocab_size, shape),
                                              metadata={"format": "pt"}),
    }
    for name, data in files.items():
        (out / name).write_bytes(data)
    return out


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "sluice"


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Return `<cache_dir>/tiny-<generator hash>`, building it on first use.

    Atomic: the model is written into a private temporary directory next to the target and
    renamed into place, so readers only ever see a complete directory. Concurrent builders race
    on the rename; the loser discards its copy (both copies are byte-identical anyway).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-{generator_hash()}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        write_tiny_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
