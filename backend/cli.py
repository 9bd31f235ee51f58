"""Subcommand of the bundled model server (`sluice backend`); `sluice up` is the gateway's.

Heavy imports (torch, uvicorn, starlette) happen inside the command functions, so that
building the `sluice` parser stays cheap.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from protocol.limits import (
    DEFAULT_BACKEND_MAX_CONNECTIONS,
    DEFAULT_BODY_MIN_BYTES_PER_S,
    DEFAULT_REQUEST_READ_S,
    ConnectionLimits,
)
from protocol.offload import OffloadSettings

DEFAULT_HOST = "127.0.0.1"
TOKENIZE = OffloadSettings()  # the defaults
DEFAULT_PORT = 8001


def _add_server_flags(p: argparse.ArgumentParser, *, model_default: str | None) -> None:
    p.add_argument("--model", default=model_default, required=model_default is None,
                   help="checkpoint directory (HF layout) or 'tiny' for the bundled model")
    p.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: the directory name, or sluice-tiny)")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="auto (float32 on cpu, bfloat16 on cuda) | float32 | bfloat16 | float16")
    p.add_argument("--quantization", default=None, choices=("int8", "int4"),
                   help="quantize the weights at load: int8 (per output channel) or int4 "
                        "(groups of 128); default: none (docs/engine.md)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-memory", type=float, default=None, metavar="GiB",
                    help="KV cache budget in GiB (default: 1 GiB on CPU, 80%% of free on GPU)")
    kv.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                    help="KV cache size in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one engine step (decode + prefill chunks)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length cap (default: the model's)")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")
    p.add_argument("--attention", default="auto", choices=("auto", "torch", "triton"),
                   help="decode attention on CUDA: the Triton kernel over the block table "
                   "(auto: where Triton imports) or torch's gather + SDPA")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: run every decode step eagerly (no graphs captured at start)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for the model's math (default: one per core but one, "
                        "which is left to the HTTP server's event loop; at least 1)")
    p.add_argument("--engine-in-process", action="store_true",
                   help="step the model on a thread of the server's process instead of in "
                        "an engine process of its own (the default)")
    p.add_argument("--seed", type=int, default=0, help="seed for unseeded sampled requests")
    p.add_argument("--speculative", default=None, metavar="ngram|draft:DIR",
                   help="speculative decoding: ngram (prompt lookup) or a draft checkpoint "
                        "sharing the tokenizer (default: off; docs/engine.md)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="draft tokens per step at most (default 4)")
    p.add_argument("--speculative-max-batch", type=int, default=None, metavar="N",
                   help="speculate only while at most N sequences decode (default 8)")
    p.add_argument("--fault-step-delay", type=float, default=0.0, metavar="MS",
                   help="fault injection: sleep MS milliseconds before every engine step, "
                        "a slow model server for resilience tests and demos (default 0)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body accepted (default 4 MiB; larger gets 413)")
    p.add_argument("--tokenize-workers", type=int, default=TOKENIZE.workers,
                   metavar="N", help="threads tokenizing long prompts at once "
                                     f"(default {TOKENIZE.workers})")
    p.add_argument("--tokenize-per-tenant", type=int, default=TOKENIZE.per_tenant,
                   metavar="N", help="one tenant's long prompts being tokenized or waiting; "
                                     f"one more gets 429 (default {TOKENIZE.per_tenant})")
    p.add_argument("--tokenize-max-waiting", type=int, default=TOKENIZE.max_waiting,
                   metavar="N", help="long prompts waiting for a tokenizing thread; one more "
                                     f"gets 503 (default {TOKENIZE.max_waiting})")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may finish before abort")
    p.add_argument("--drain-grace", type=float, default=0.0, metavar="SECONDS",
                   help="after SIGTERM, keep accepting this long, answering 503 with "
                        "Retry-After, before closing the listener (default 0)")
    p.add_argument("--request-read-timeout", type=float, default=DEFAULT_REQUEST_READ_S,
                   metavar="SECONDS",
                   help="a request head must arrive within this (else 408), and a body "
                        "gets it as a grace before --min-body-rate counts "
                        f"(default {DEFAULT_REQUEST_READ_S:g})")
    p.add_argument("--min-body-rate", type=int, default=DEFAULT_BODY_MIN_BYTES_PER_S,
                   metavar="BYTES_PER_S",
                   help="a request body slower than this on average is cut with 408 "
                        f"(default {DEFAULT_BODY_MIN_BYTES_PER_S})")
    p.add_argument("--max-connections", type=int, default=DEFAULT_BACKEND_MAX_CONNECTIONS,
                   metavar="N",
                   help="open client connections at once; one more gets 503 with "
                        "Retry-After. Keep it above the sum of the gateways' pools to it "
                        "(models[].max_connections, 1024 each) "
                        f"(default {DEFAULT_BACKEND_MAX_CONNECTIONS})")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="every route but /health needs 'Authorization: Bearer KEY' "
                        "(default: $SLUICE_BACKEND_API_KEY, which `ps` does not show; one "
                        "of the two, or --no-api-key, is required)")
    p.add_argument("--no-api-key", action="store_true",
                   help="serve without a key: anyone who reaches the port may generate, "
                        "read the state and time the prefix cache (local experiments only)")


def _backend(args: argparse.Namespace) -> int:
    import logging

    from backend.engine.async_engine import AsyncEngine
    from backend.engine.config import EngineConfig
    from backend.engine.errors import EngineError
    from backend.engine.process_transport import ProcessTransport
    from backend.engine.thread_transport import ThreadTransport
    from backend.faults import step_delay_hook
    from backend.server.app import ServerSettings
    from backend.server.auth import resolve_api_key
    from backend.server.serve import serve
    from modelfiles.errors import ModelFileError
    from telemetry import Telemetry, TelemetryError

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.drain_grace < 0 or args.shutdown_timeout < 0:
        print("sluice backend: --drain-grace and --shutdown-timeout must be >= 0",
              file=sys.stderr)
        return 2
    try:
        limits = ConnectionLimits(request_read_s=args.request_read_timeout,
                                  body_min_bytes_per_s=args.min_body_rate,
                                  max_connections=args.max_connections)
    except ValueError as exc:
        print(f"sluice backend: {exc}", file=sys.stderr)
        return 2
    try:
        tokenize = OffloadSettings(workers=args.tokenize_workers,
                                   per_tenant=args.tokenize_per_tenant,
                                   max_waiting=args.tokenize_max_waiting)
    except ValueError as exc:
        print(f"sluice backend: {exc}", file=sys.stderr)
        return 2
    try:  # before the model loads: a missing key fails fast
        api_key = resolve_api_key(args.api_key, args.no_api_key, os.environ)
    except ValueError as exc:
        print(f"sluice backend: cannot start: {exc}", file=sys.stderr)
        return 2
    if api_key is None:
        logging.getLogger("sluice.backend").warning(
            "--no-api-key: anyone who reaches %s:%d may use this server", args.host, args.port)
    try:  # before the model loads: a bad OTEL_* setting fails fast
        telemetry = Telemetry.create("sluice-backend", scope="sluice.backend")
    except TelemetryError as exc:
        print(f"sluice backend: cannot start: {exc}", file=sys.stderr)
        return 2
    try:
        step_hook = step_delay_hook(args.fault_step_delay)
    except ValueError as exc:
        telemetry.shutdown()
        print(f"sluice backend: {exc}", file=sys.stderr)
        return 2
    try:
        config = EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype,
            block_size=args.block_size, kv_memory_gib=args.kv_memory, kv_blocks=args.kv_blocks,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, enable_prefix_cache=not args.no_prefix_cache,
            seed=args.seed, served_model_name=args.served_model_name,
            quantization=args.quantization, attention=args.attention,
            cuda_graphs=not args.no_cuda_graphs,
            num_threads=args.threads, reserve_cores=1, speculative=args.speculative,
            num_speculative_tokens=args.num_speculative_tokens,
            speculative_max_batch=args.speculative_max_batch)
        # The core steps in an engine process of its own, or on a thread of this one.
        transport = ThreadTransport if args.engine_in_process else ProcessTransport
        engine = AsyncEngine(transport.from_config(config, step_hook=step_hook))
    except (EngineError, ModelFileError, OSError) as exc:
        telemetry.shutdown()
        print(f"sluice backend: cannot start: {exc}", file=sys.stderr)
        return 2
    settings = ServerSettings(host=args.host, port=args.port, max_body_bytes=args.max_body_bytes,
                              shutdown_timeout_s=args.shutdown_timeout,
                              drain_grace_s=args.drain_grace, limits=limits,
                              log_level=args.log_level, access_log=args.access_log,
                              api_key=api_key, tokenize=tokenize)
    model = engine.info.model_name if engine.info is not None else args.model

    def ready() -> None:
        host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
        url = f"http://{host}:{args.port}"
        print(f"sluice backend ready: model {model} at {url}/v1", flush=True)

    return serve(engine, settings, on_ready=ready, telemetry=telemetry)


def register(sub: Any) -> None:
    """Add the backend's subcommand to the `sluice` parser."""
    p = sub.add_parser("backend", help="run the bundled OpenAI-compatible model server")
    _add_server_flags(p, model_default=None)
    p.set_defaults(func=_backend)
