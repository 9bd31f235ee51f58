"""Engine configuration (a frozen value object; pydantic lives at the edges)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from modelfiles.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

from .errors import InvalidRequestError

METHODS = ("ngram", "draft")
MAX_SPEC_TOKENS = 16
# Decoding batches above this many sequences do not speculate (the step is compute-bound
# there; ``python -m backend.bench.spec`` measures where the gain ends).
DEFAULT_MAX_BATCH = 8


@dataclass(slots=True, frozen=True)
class SpecConfig:
    """How an engine speculates: ``method`` ngram or draft (with ``draft_model``, a
    checkpoint directory), ``num_tokens`` (K) drafts a step at most, and the largest
    decoding batch that still speculates."""

    method: str
    num_tokens: int = 4
    draft_model: str | None = None
    max_batch: int = DEFAULT_MAX_BATCH

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(
                f"speculative must be ngram or draft:DIR, got {self.method!r}", "speculative")
        if (self.method == "draft") != bool(self.draft_model):
            raise InvalidRequestError("speculative draft needs a checkpoint: draft:DIR",
                                      "speculative")
        if not isinstance(self.num_tokens, int) or not 1 <= self.num_tokens <= MAX_SPEC_TOKENS:
            raise InvalidRequestError(
                f"num_speculative_tokens must be in 1..{MAX_SPEC_TOKENS}",
                "num_speculative_tokens")
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise InvalidRequestError("speculative_max_batch must be >= 1",
                                      "speculative_max_batch")

    @classmethod
    def parse(cls, value: str, num_tokens: int = 4,
              max_batch: int | None = None) -> SpecConfig:
        """``ngram`` or ``draft:DIR``, as ``--speculative`` takes it."""
        method, _, model = value.partition(":")
        return cls(method=method, num_tokens=num_tokens, draft_model=model or None,
                   max_batch=DEFAULT_MAX_BATCH if max_batch is None else max_batch)

    def describe(self, draft_revision: str | None = None) -> str:
        """The config as the engine's version names it (``versions.engine_version``):
        ``spec-ngram-k4-b8``, or ``spec-draft.<revision, 12 hex>-k4-b8``."""
        what = self.method if draft_revision is None else f"draft.{draft_revision[:12]}"
        return f"spec-{what}-k{self.num_tokens}-b{self.max_batch}"


# Weight-only quantization formats (quant.py): int8 per output channel, int4 in groups of 128.
QUANTIZATIONS = ("int8", "int4")
# Decode attention (EngineConfig.attention)
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model: str = "tiny"  # a checkpoint directory, or "tiny" for the bundled default
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on cpu, bfloat16 on cuda) | float32 | bfloat16 | float16
    block_size: int = 16
    kv_memory_gib: float | None = None  # KV budget; exclusive with kv_blocks
    kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    aging_s: float = 2.0  # waiting this long makes a request one priority level more urgent
    seed: int = 0  # seeds unseeded requests' generators, so a run is repeatable
    cache_dir: str | None = None  # where "tiny" is built; default ~/.cache/sluice
    num_threads: int | None = None  # CPU: torch intra-op threads (None: torch's default)
    # CPU, when num_threads is None: cores left out of the model's math for the rest of the
    # process (the HTTP server's event loop), so that its thread pool does not oversubscribe
    # them. Never below one thread.
    reserve_cores: int = 0
    decode_kernel: bool = True  # CPU: compile and use the C decode-attention kernel
    # CPU, with the kernel: steps where every sequence decodes run fused in C
    fused_decode: bool = True
    # decode attention over the paged cache on CUDA: "auto" (the Triton kernel where Triton
    # imports, else torch's gather + SDPA), "torch", or "triton" (required: an error
    # without it; on the CPU, in place of the C kernel, only under TRITON_INTERPRET=1)
    attention: str = "auto"
    # CUDA: replay decode steps from CUDA graphs captured at start-up, at batch-size
    # buckets (cuda_graphs.py); False: every step runs eagerly
    cuda_graphs: bool = True
    # sample on the model's device, copying only the picked ids to the host
    # (``sampler.sample_batch``); None: on every device but the CPU
    device_sampler: bool | None = None
    served_model_name: str | None = None
    # weight-only quantization at load (quant.py): None, "int8" or "int4"
    quantization: str | None = None
    # speculative decoding (spec.py): None, "ngram" or "draft:DIR"; K; the largest
    # decoding batch that speculates (None: DEFAULT_MAX_BATCH)
    speculative: str | None = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int | None = None

    @property
    def spec(self) -> SpecConfig | None:
        if self.speculative is None:
            return None
        return SpecConfig.parse(self.speculative, self.num_speculative_tokens,
                                self.speculative_max_batch)

    def __post_init__(self) -> None:
        if self.speculative is not None and not isinstance(self.speculative, str):
            raise InvalidRequestError("speculative must be ngram or draft:DIR", "speculative")
        _ = self.spec  # validates
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(
                f"unknown quantization {self.quantization!r}; use one of "
                f"{', '.join(QUANTIZATIONS)} (or none: the checkpoint's dtype)", "quantization")
        if self.attention not in ATTENTION_BACKENDS:
            raise InvalidRequestError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}",
                                      "attention")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size must be a positive power of two", "block_size")
        if self.kv_memory_gib is not None and self.kv_blocks is not None:
            raise InvalidRequestError("give kv_memory_gib or kv_blocks, not both", "kv_blocks")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise InvalidRequestError("kv_blocks must be >= 1", "kv_blocks")
        if self.kv_memory_gib is not None and self.kv_memory_gib <= 0:
            raise InvalidRequestError("kv_memory_gib must be > 0", "kv_memory_gib")
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be >= 1", "max_num_seqs")
        if self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_batched_tokens must be >= 1",
                                      "max_num_batched_tokens")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len must be >= 2", "max_model_len")
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidRequestError("num_threads must be >= 1", "num_threads")
        if self.reserve_cores < 0:
            raise InvalidRequestError("reserve_cores must be >= 0", "reserve_cores")
        if self.aging_s <= 0:
            raise InvalidRequestError("aging_s must be > 0", "aging_s")


def resolve_model_path(config: EngineConfig) -> tuple[Path, str]:
    """The checkpoint directory (``tiny`` is written on first use) and the served name."""
    if config.model == "tiny":
        cache = Path(config.cache_dir) if config.cache_dir else None
        return ensure_tiny_model(cache), config.served_model_name or TINY_MODEL_NAME
    path = Path(config.model).expanduser()
    return path, config.served_model_name or path.name
