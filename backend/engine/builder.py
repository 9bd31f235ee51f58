"""Assemble an engine from an ``EngineConfig``: model, tokenizer, KV cache, versions.

The engine's composition root: ``build_engine`` makes every collaborator of the
``LLMEngine`` (model runner, block manager, scheduler, detokenizer, prefix-cache salt) and
hands them in. What the caller injects beyond the config (the step hook, for fault
injection) comes in as an argument, never as a setting.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from modelfiles.model_config import ModelConfig
from modelfiles.revision import model_revision
from modelfiles.tokenizer import Tokenizer
from protocol.versions import ResolvedVersions, ServedVersions

from .block_manager import BlockManager
from .config import EngineConfig, resolve_model_path
from .cuda_graphs import DecodeGraphs
from .decode_kernel import load_decode_kernel
from .detokenizer import IncrementalDetokenizer
from .draft import DraftProposer, load_draft
from .engine import LLMEngine, StepHook
from .errors import InvalidRequestError
from .grammar import GrammarCompiler
from .kv_cache import allocate_kv_cache, kv_bytes_per_block
from .model_runner import ModelRunner
from .models.linear import can_prepack
from .quant_artifact import load_weights
from .scheduler import Scheduler
from .spec import NgramProposer, Proposer
from .transport import EngineInfo
from .versions import engine_version, prefix_cache_salt

log = logging.getLogger("sluice.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "half": torch.float16, "float": torch.float32}

DEFAULT_CPU_KV_GIB = 1.0
DEFAULT_CUDA_KV_FRACTION = 0.8


@dataclass(slots=True)
class EngineParts:
    """Everything built for one engine, for the server and the bench to use."""

    core: LLMEngine
    runner: ModelRunner
    model_config: ModelConfig
    tokenizer: Tokenizer
    versions: ResolvedVersions
    model_name: str
    model_path: Path
    device: torch.device
    dtype: torch.dtype
    num_blocks: int
    kv_bytes_per_block: int

    def info(self) -> EngineInfo:
        """What the server reads of this engine (stepped by this process)."""
        return EngineInfo(
            tokenizer=self.tokenizer, versions=self.versions, model_name=self.model_name,
            model_path=self.model_path, device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."), num_blocks=self.num_blocks,
            kv_bytes_per_block=self.kv_bytes_per_block, limits=self.core.limits,
            pid=os.getpid())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("device cuda was asked for but CUDA is not available",
                                  "device")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise InvalidRequestError(f"unknown device {name!r}", "device") from exc


def cpu_threads(config: EngineConfig, device: torch.device) -> int | None:
    """The intra-op thread count to set, or None to keep torch's.

    An explicit ``num_threads`` wins, then ``OMP_NUM_THREADS``. Otherwise on CPU,
    ``reserve_cores`` cores are left to the serving process: one thread per core this
    process may run on, minus the reserve, at least one.
    """
    if config.num_threads is not None:
        return config.num_threads
    if device.type != "cpu" or config.reserve_cores == 0 or os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - config.reserve_cores)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16", "dtype") from None


def build_engine(config: EngineConfig, *, step_hook: StepHook | None = None,
                 static_decode: bool = False) -> EngineParts:
    """Load the model and build the engine ``config`` describes. ``step_hook`` runs before
    the model in every step that runs it (``LLMEngine``). ``static_decode`` (tests): decode
    steps run through the CUDA graphs' static buffers, eagerly, on any device."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    threads = cpu_threads(config, device)
    if threads is not None:
        # Process-wide: the engine owns its process's CPU math (server, bench).
        torch.set_num_threads(threads)
    path, name = resolve_model_path(config)
    # weight quantization (quant.py) at load, or a quantized artifact (quant_artifact.py):
    # named in the engine version, and so in the prefix-cache salt
    loaded, quantization = load_weights(path, dtype, device, config.quantization)
    quant = () if quantization is None else (quantization,)
    mcfg = loaded.config
    if can_prepack(device):
        loaded.model.prepack_cpu_matmuls()
    in_place = False  # decode attention reads the block table in place (Triton)
    if device.type == "cpu" and config.decode_kernel and config.attention != "triton":
        loaded.model.set_decode_kernel(load_decode_kernel(), fused=config.fused_decode)
    elif config.attention == "triton" or (device.type == "cuda" and config.attention == "auto"):
        from .triton_attention import TritonDecodeAttention, available  # imports triton
        kernel = TritonDecodeAttention()
        why = kernel.self_test(device, dtype) if available(device) else \
            "needs Triton, and CUDA (or TRITON_INTERPRET=1 on the CPU)"
        if why is None:
            loaded.model.set_decode_kernel(kernel, fused=False)
            in_place = True
        elif config.attention == "triton":
            raise InvalidRequestError(f"attention=triton: {why}", "attention")
        else:
            log.warning("the Triton decode-attention kernel is not used (%s): torch's "
                        "gather + SDPA instead", why)
    tokenizer = Tokenizer.from_dir(path)
    spec = config.spec
    draft = None if spec is None or spec.draft_model is None else \
        load_draft(spec.draft_model, mcfg, dtype, device, config)
    features = () if spec is None else (
        spec.describe(None if draft is None else model_revision(draft.path)),)
    versions = ResolvedVersions(name, ServedVersions(
        revision=model_revision(path),
        tokenizer=tokenizer.sha256,
        chat_template=tokenizer.chat_template_sha256,
        engine=engine_version(*quant, *features),
    ))
    model_len = mcfg.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > model_len:
            raise InvalidRequestError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {model_len}", "max_model_len")
        model_len = config.max_model_len
    bs = config.block_size
    per_block = kv_bytes_per_block(mcfg, bs, dtype)
    # a draft model keeps its K/V in blocks of its own, one per target block (draft.py)
    both = per_block + (0 if draft is None else kv_bytes_per_block(draft.config, bs, dtype))
    if config.kv_blocks is not None:
        num_blocks = config.kv_blocks
    elif config.kv_memory_gib is not None:
        num_blocks = int(config.kv_memory_gib * (1 << 30)) // both
    else:
        num_blocks = _default_num_blocks(config, mcfg, dtype, device, model_len, both)
    if num_blocks < 1:
        raise InvalidRequestError("the KV budget holds no block", "kv_memory_gib")
    # A request must be able to run alone: cap the context length to the KV capacity.
    max_model_len = min(model_len, num_blocks * bs)
    graphs = static_decode or (device.type == "cuda" and config.cuda_graphs and in_place)
    # with graphs, one block more: the padding rows' scratch (cuda_graphs.py), never handed
    # out by the block manager
    kv = allocate_kv_cache(mcfg, num_blocks + (1 if graphs else 0), bs, dtype, device)
    runner = ModelRunner(loaded.model, kv, bs, device)
    if graphs:
        runner.graphs = DecodeGraphs(loaded.model, kv, bs, device, config.max_num_seqs,
                                     max_model_len, scratch_block=num_blocks,
                                     capture=not static_decode)
    proposer: Proposer | None = None
    if draft is not None:
        draft_kv = allocate_kv_cache(draft.config, num_blocks, bs, dtype, device)
        proposer = DraftProposer(ModelRunner(draft.model, draft_kv, bs, device),
                                 runner.argmax)
    elif spec is not None:
        proposer = NgramProposer()
    eos = tokenizer.eos_token_ids or tuple(mcfg.eos_token_ids)
    scheduler = Scheduler(
        BlockManager(num_blocks, bs, config.enable_prefix_cache),
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        aging_s=config.aging_s,
        num_spec_tokens=0 if spec is None else spec.num_tokens,
        spec_max_batch=0 if spec is None else spec.max_batch,
    )
    core = LLMEngine(
        runner=runner,
        scheduler=scheduler,
        vocab_size=mcfg.vocab_size,
        eos_token_ids=tuple(eos),
        make_detokenizer=lambda prompt: IncrementalDetokenizer(tokenizer, prompt),
        make_salt=functools.partial(prefix_cache_salt, versions),
        seed=config.seed,
        step_hook=step_hook,
        proposer=proposer,
        grammars=GrammarCompiler.for_tokenizer(tokenizer, mcfg.vocab_size, tuple(eos)),
        batch_sampling=device.type != "cpu" if config.device_sampler is None
        else config.device_sampler,
    )
    log.info("engine ready: model=%s device=%s dtype=%s kv_blocks=%d x %d tokens "
             "max_model_len=%d cpu_threads=%d", name, device, dtype, num_blocks, bs,
             max_model_len, torch.get_num_threads())
    return EngineParts(core=core, runner=runner, model_config=mcfg, tokenizer=tokenizer,
                       versions=versions, model_name=name, model_path=path, device=device,
                       dtype=dtype, num_blocks=num_blocks, kv_bytes_per_block=per_block)


def _default_num_blocks(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype,
                        device: torch.device, model_len: int, per_block: int) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_CUDA_KV_FRACTION) // per_block
    # On the CPU, enough for every sequence slot at full length, within a default budget.
    wanted = config.max_num_seqs * (-(-model_len // config.block_size))
    budget = int(DEFAULT_CPU_KV_GIB * (1 << 30)) // per_block
    return max(1, min(wanted, budget))
