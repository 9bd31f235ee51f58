"""KV-cache capacity planning: the arithmetic behind `sluice plan`.

The figures are the ones the capacity lesson teaches, computed from the model's own
``config.json`` (parsed by `modelfiles`' `ModelConfig`, the engine's own, so the planner and
the engine agree on layers, KV heads and head dimension):

- weights: parameters (counted from the Llama-family shapes) × bytes per weight;
- KV per token: ``2 · L · H_kv · d_head · b`` (K and V, every layer); per sequence: × T.
  32 layers, 8 KV heads, head dim 128, 2 bytes and T = 8192 give exactly 1 GiB;
- the KV pool: ``gpu_memory × utilization − weights``, cut into whole blocks of
  ``block_size`` tokens, as the paged engine allocates it;
- block rounding: a sequence of n tokens holds ``ceil(n / B)`` blocks, so up to B − 1 token
  slots are allocated and unused;
- quantized weights (``--quantization``, Sluice's own formats: ``sluice backend
  --quantization``): every matrix, the embedding and the LM head at 1 byte a weight + a
  float32 scale per output row (int8), or half a byte + a float32 scale per 128 weights of
  a row (int4; an untied embedding stays int8); norms and biases stay in the model dtype.
  The unquantized fallback's plan is made beside it, so that the capacity a fallback
  costs is known;
- concurrency: whole blocks divided by the blocks one sequence holds at its full length
  (input + output: the worst case the gateway reserves), at the context length and at the
  workload's length distribution;
- failover headroom: N replicas serve N × S sequences, N − 1 of them survive one failure, so
  each replica must run at most (N − 1) / N of S for the survivors to absorb a failed one.

Invariants: every byte count is an exact integer (no float rounding in what the tests check);
the only float inputs are the utilization fraction and sub-byte weight types (int4).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from modelfiles.model_config import ModelConfig

GIB = 1 << 30

# Bytes per element. Weights may be quantized below a byte (int4: scales and zero points are
# not counted); the KV cache holds whole-byte elements only.
WEIGHT_DTYPES: dict[str, float] = {
    "fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
    "fp8": 1, "int8": 1, "int4": 0.5,
}
KV_DTYPES: dict[str, int] = {
    "fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
# Sluice's weight quantization (backend/engine/quant.py): formats and the int4 group size
QUANTIZATIONS = ("int8", "int4")
QUANT_GROUP = 128
_SCALE_BYTES = 4  # float32
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


class PlanError(ValueError):
    """A size, dtype, path or shape the planner cannot use; the CLI exits with status 2."""


def parse_size(text: str) -> int:
    """``80GiB`` → bytes. GiB/MiB/... and bare K/M/G/T are powers of 1024 (Docker's
    convention); GB/MB/... are powers of 1000; ``B`` is bytes. A unit is required."""
    match = _SIZE.match(text)
    if match is None or match.group(2) is None:
        raise PlanError(f"cannot read the size {text!r}: give a number and a unit, e.g. 80GiB")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "b":
        value = number
    else:
        base = 1000 if unit.endswith("b") and not unit.endswith("ib") else 1024
        value = number * base ** _POWERS[unit[0]]
    if value < 1:
        raise PlanError(f"the size {text!r} is not positive")
    return int(value)


def weight_bytes_per_param(name: str) -> float:
    try:
        return WEIGHT_DTYPES[name.lower()]
    except KeyError:
        raise PlanError(f"unknown weight dtype {name!r}; known: "
                        f"{', '.join(sorted(WEIGHT_DTYPES))}") from None


def kv_bytes_per_element(name: str) -> int:
    try:
        return KV_DTYPES[name.lower()]
    except KeyError:
        raise PlanError(f"unknown KV dtype {name!r}; known: "
                        f"{', '.join(sorted(KV_DTYPES))}") from None


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of a Llama-family decoder (Llama, Mistral, Qwen2) from its shapes."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    attention = h * q + 2 * h * kv + q * h
    if cfg.attention_bias:
        attention += q + 2 * kv
    if cfg.o_proj_bias:
        attention += h
    mlp = 3 * h * cfg.intermediate_size
    layer = attention + mlp + 2 * h  # + input and post-attention RMSNorm weights
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_hidden_layers * layer + embeddings + h  # + the final norm


def matrix_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of every matrix a quantized engine stores: per layer q/k/v (one fused
    matrix), o, gate/up (fused) and down; the LM head; the embedding unless tied (last)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    layer = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
    heads = [(cfg.vocab_size, h)] * (1 if cfg.tie_word_embeddings else 2)
    return layer * cfg.num_hidden_layers + heads


def quantized_weight_bytes(cfg: ModelConfig, kind: str, dtype: str) -> int:
    """Exact bytes of a model quantized to ``kind``: the matrices' integers and scales,
    the other parameters (norms, biases) in ``dtype``."""
    if kind not in QUANTIZATIONS:
        raise PlanError(f"unknown quantization {kind!r}; known: {', '.join(QUANTIZATIONS)}")
    shapes = matrix_shapes(cfg)
    rest = count_parameters(cfg) - sum(n * k for n, k in shapes)
    int8 = shapes if kind == "int8" else shapes[-1:] if not cfg.tie_word_embeddings else []
    int4 = shapes[:len(shapes) - len(int8)]
    matrices = sum(n * k + n * _SCALE_BYTES for n, k in int8) + sum(
        -(-n * k // 2) + n * -(-k // QUANT_GROUP) * _SCALE_BYTES for n, k in int4)
    return matrices + math.ceil(rest * weight_bytes_per_param(dtype))


def kv_bytes_per_token(cfg: ModelConfig, element_bytes: int) -> int:
    """``2 · L · H_kv · d_head · b``: K and V of one token across every layer."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element_bytes


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(slots=True, frozen=True)
class LengthMix:
    """A workload's length distribution: (input, output, probability) triples that fit the
    context, and the probability mass of those that do not (the engine refuses them)."""

    pairs: tuple[tuple[int, int, float], ...]
    refused: float

    @classmethod
    def from_weighted(cls, pairs: list[tuple[int, int, float]], context: int) -> LengthMix:
        """Normalize the weights; pairs longer than ``context`` count as refused."""
        total = sum(w for _, _, w in pairs)
        if not pairs or total <= 0:
            raise PlanError("the workload has no length pairs with a positive weight")
        fits = tuple((i, o, w / total) for i, o, w in pairs if i + o <= context and w > 0)
        if not fits:
            raise PlanError(f"no request of the workload fits the context of {context} tokens")
        return cls(fits, 1.0 - sum(p for _, _, p in fits))

    def mean_tokens(self) -> float:
        return sum((i + o) * p for i, o, p in self.pairs) / self.kept

    def mean_blocks(self, block_size: int) -> float:
        return sum(blocks_for(i + o, block_size) * p for i, o, p in self.pairs) / self.kept

    @property
    def kept(self) -> float:
        return sum(p for _, _, p in self.pairs)


@dataclass(slots=True, frozen=True)
class PlanInput:
    gpu_bytes: int
    weight_dtype: str = "bf16"
    kv_dtype: str | None = None  # None: the weights' dtype, or bf16 under quantized weights
    context: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    replicas: int = 1
    utilization: float = 0.90  # share of GPU memory the engine may use (vLLM's default)
    sequences: int | None = None  # also size this many unshared sequences at the context
    quantization: str | None = None  # int8 | int4: Sluice's quantized weights (weight_dtype:
    # the model dtype their norms, biases and KV cache keep)


def resolved_kv_dtype(inp: PlanInput) -> str:
    if inp.kv_dtype is not None:
        return inp.kv_dtype
    return inp.weight_dtype if inp.weight_dtype.lower() in KV_DTYPES else "bf16"


def validate(inp: PlanInput, cfg: ModelConfig) -> int:
    """Check the inputs against each other and the model; returns the context length."""
    if inp.block_size < 1 or inp.block_size & (inp.block_size - 1):
        raise PlanError(f"--block-size must be a positive power of two, not {inp.block_size}")
    if inp.replicas < 1:
        raise PlanError(f"--replicas must be >= 1, not {inp.replicas}")
    if not 0 < inp.utilization <= 1:
        raise PlanError(f"--gpu-utilization must be in (0, 1], not {inp.utilization}")
    if inp.sequences is not None and inp.sequences < 1:
        raise PlanError(f"--sequences must be >= 1, not {inp.sequences}")
    context = cfg.max_position_embeddings if inp.context is None else inp.context
    if context < 1:
        raise PlanError(f"--context must be >= 1, not {context}")
    if context > cfg.max_position_embeddings:
        raise PlanError(f"--context {context} exceeds the model's "
                        f"{cfg.max_position_embeddings} positions")
    weight_bytes_per_param(inp.weight_dtype)
    kv_bytes_per_element(resolved_kv_dtype(inp))
    if inp.quantization is not None:
        if inp.quantization not in QUANTIZATIONS:
            raise PlanError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                            f"not {inp.quantization!r}")
        if inp.weight_dtype.lower() not in KV_DTYPES or inp.weight_dtype.lower() == "fp8":
            raise PlanError(f"--quantization {inp.quantization} quantizes a bf16, fp16 or "
                            f"fp32 model: give that dtype with --dtype, not "
                            f"{inp.weight_dtype!r}")
    return context


@dataclass(slots=True, frozen=True)
class Plan:
    """Every figure `sluice plan` prints; byte counts are exact integers."""

    parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    context: int
    kv_bytes_per_sequence: int
    usable_bytes: int
    kv_pool_bytes: int  # < 0: the weights alone do not fit
    block_size: int
    block_bytes: int
    kv_blocks: int
    blocks_per_context_sequence: int
    rounding_tokens_at_context: int  # slots allocated past the context length
    max_sequences_at_context: int
    workload_mean_tokens: float | None
    workload_mean_blocks: float | None
    workload_rounding_fraction: float | None  # of the KV held by the workload's sequences
    workload_refused_fraction: float | None  # probability mass longer than the context
    max_sequences_at_workload: int | None
    sequences: int | None
    sequences_kv_bytes: int | None
    sequences_fit: bool | None
    replicas: int
    fleet_sequences: int
    surviving_sequences: int  # after one replica fails
    safe_sequences_per_replica: int  # load per replica that the survivors can absorb

    @property
    def fits(self) -> bool:
        return self.kv_blocks > 0


def make_plan(cfg: ModelConfig, inp: PlanInput, mix: LengthMix | None = None) -> Plan:
    context = validate(inp, cfg)
    params = count_parameters(cfg)
    if inp.quantization is not None:
        weights = quantized_weight_bytes(cfg, inp.quantization, inp.weight_dtype)
    else:
        weights = math.ceil(params * weight_bytes_per_param(inp.weight_dtype))
    per_token = kv_bytes_per_token(cfg, kv_bytes_per_element(resolved_kv_dtype(inp)))
    usable = int(inp.gpu_bytes * inp.utilization)
    pool = usable - weights
    bs = inp.block_size
    block_bytes = per_token * bs
    blocks = max(0, pool) // block_bytes
    per_ctx = blocks_for(context, bs)
    at_context = blocks // per_ctx
    mean_tokens = mean_blocks = rounding = refused = None
    at_workload = None
    if mix is not None:
        mean_tokens, mean_blocks = mix.mean_tokens(), mix.mean_blocks(bs)
        rounding, refused = 1.0 - mean_tokens / (mean_blocks * bs), mix.refused
        at_workload = math.floor(blocks / mean_blocks)
    per_replica = at_context if at_workload is None else at_workload
    n = inp.replicas
    seqs = inp.sequences
    return Plan(
        parameters=params, weight_bytes=weights, kv_bytes_per_token=per_token,
        context=context, kv_bytes_per_sequence=per_token * context, usable_bytes=usable,
        kv_pool_bytes=pool, block_size=bs, block_bytes=block_bytes, kv_blocks=blocks,
        blocks_per_context_sequence=per_ctx, rounding_tokens_at_context=per_ctx * bs - context,
        max_sequences_at_context=at_context, workload_mean_tokens=mean_tokens,
        workload_mean_blocks=mean_blocks, workload_rounding_fraction=rounding,
        workload_refused_fraction=refused, max_sequences_at_workload=at_workload,
        sequences=seqs, sequences_kv_bytes=None if seqs is None else seqs * per_token * context,
        sequences_fit=None if seqs is None else seqs * per_ctx <= blocks,
        replicas=n, fleet_sequences=n * per_replica, surviving_sequences=(n - 1) * per_replica,
        safe_sequences_per_replica=(n - 1) * per_replica // n,
    )
