"""Engine configuration (a frozen value object; pydantic lives at the edges)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from modelfiles.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

from .errors import InvalidRequestError


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
    served_model_name: str | None = None

    def __post_init__(self) -> None:
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
