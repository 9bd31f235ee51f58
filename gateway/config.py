"""The gateway's two YAML files, validated at the edge with pydantic.

``gateway.yaml`` says where to listen and which public model names map to which upstreams;
``tenants.yaml`` says who may call (keys stored only as SHA-256 hashes) and within which
limits. Every setting of ``gateway.yaml`` can be overridden by an environment variable
``SLUICE_<PATH>``, nested keys joined by ``__`` (``SLUICE_LISTEN__PORT=9000``); the value is
read as YAML, so numbers and booleans keep their types. ``SLUICE_REDIS_URL`` sets
``store.url``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from policies.breaker import RAMP_STEPS
from protocol.contract import CAPABILITIES, OPENAI_CAPABILITIES, SLUICE_CAPABILITIES
from protocol.limits import (
    DEFAULT_BODY_MIN_BYTES_PER_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_READ_S,
    ConnectionLimits,
)
from protocol.offload import OffloadSettings
from telemetry.config import TelemetryConfig

from .errors import ConfigError
from .media import ImageRule, MediaCosts
from .tenant_config import (
    Caps,
    DegradeConfig,
    FallbackConfig,
    PriorityRange,
    QuotasConfig,
    TenantEntry,
    TenantsFile,
)

# The tenant models live in tenant_config.py and are importable from here too.
__all__ = [
    "ENV_PREFIX", "AdminConfig", "AdmissionConfig", "BreakerConfig", "Capacity", "Caps",
    "DegradeConfig", "FallbackConfig", "GatewayConfig", "Listen", "MemberEntry", "ModelEntry",
    "PriorityRange", "QueueConfig", "QuotasConfig", "ResilienceConfig", "RetryConfig",
    "StaticVersions", "StoreConfig", "TenantEntry", "TenantsFile", "Timeouts", "TokenizeConfig",
    "apply_env", "load_gateway_config", "load_tenants",
]

ENV_PREFIX = "SLUICE_"

# Optional request features an upstream may or may not implement (protocol.contract): a
# request that uses one (with a non-default value) on a model whose upstream lacks it gets
# a 400 naming the field. A kind-"sluice" upstream has SLUICE_CAPABILITIES, what the bundled
# backend serves; any other OPENAI_CAPABILITIES, unless its entry says otherwise.


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listen(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Kernel send buffer of each client connection (SO_SNDBUF, inherited from the listening
    # socket). None: Linux autotunes it up to tcp_wmem's max (4 MiB), which a client that
    # stops reading fills before the stall timeout can start counting.
    send_buffer_bytes: int | None = Field(None, ge=4096)
    # Open client connections at once; one more gets 503 too_many_connections + Retry-After
    # (protocol/limits.py). Keep it under the process's file limit (ulimit -n).
    max_connections: int = Field(DEFAULT_MAX_CONNECTIONS, ge=1)


class Timeouts(_Strict):
    """Separate limits, each with its own error (docs/resilience.md#timeouts)."""

    connect_s: float = Field(5.0, gt=0)
    # Longest wait for any byte from the upstream: the default of first_byte_s and idle_s.
    read_s: float = Field(600.0, gt=0)
    first_byte_s: float | None = Field(None, gt=0)  # request sent -> the answer's headers
    idle_s: float | None = Field(None, gt=0)  # longest gap between two chunks of an answer
    total_s: float | None = Field(None, gt=0)  # request received -> answer ended (a deadline)
    # A client whose socket takes no bytes for this long is cancelled (its upstream aborted).
    client_stall_s: float = Field(30.0, gt=0)
    # Slow senders (protocol/limits.py): the request head must arrive within request_read_s
    # (else 408); the body at body_min_bytes_per_s on average after that grace (else 408).
    request_read_s: float = Field(DEFAULT_REQUEST_READ_S, gt=0, allow_inf_nan=False)
    body_min_bytes_per_s: int = Field(DEFAULT_BODY_MIN_BYTES_PER_S, ge=1)

    @property
    def first_byte(self) -> float:
        return self.first_byte_s or self.read_s

    @property
    def idle(self) -> float:
        return self.idle_s or self.read_s


class StaticVersions(_Strict):
    """Versions for an upstream that does not report them (any OpenAI-compatible server)."""

    revision: str = "unknown"
    tokenizer: str = "unknown"
    chat_template: str | None = None
    engine: str = "unknown"


class Capacity(_Strict):
    """What the upstream can hold at once; the bundled backend reports it (/v1/state)."""

    kv_tokens: int | None = Field(None, ge=1)  # KV cache size in tokens
    max_seqs: int | None = Field(None, ge=1)  # sequences in one batch


class MemberEntry(_Strict):
    """One server of a model's pool."""

    url: str
    kind: Literal["sluice", "openai"] | None = None  # default: the model's kind
    weight: float = Field(1.0, gt=0)  # a bigger server takes a bigger share of the load

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _base_url(v)


def _base_url(v: str) -> str:
    if not re.match(r"^https?://[^/\s]+", v):
        raise ValueError("upstream must be an http(s) base URL such as http://127.0.0.1:8001")
    return v.rstrip("/").removesuffix("/v1")


class ImageTokens(_Strict):
    """An image's cost in tokens, OpenAI's tiled rule (gateway/media.py)."""

    fixed: int = Field(ge=0, le=1_000_000)
    per_tile: int = Field(0, ge=0, le=1_000_000)
    tile: int = Field(512, ge=1, le=65_536)
    fit: int = Field(2048, ge=1, le=65_536)
    short_side: int = Field(768, ge=1, le=65_536)


class ModelEntry(_Strict):
    name: str = Field(min_length=1, max_length=256)
    upstream: str  # the only server, or the first of ``upstreams``
    # A pool: several servers of the same model (URLs, or {url, kind, weight}).
    upstreams: list[MemberEntry] | None = None
    # least_load: fewest in-flight worst-case tokens per weight; prefix: a consistent hash
    # of the tenant and the prompt's start (prefix-cache hits), within load_bound × average
    routing: Literal["least_load", "prefix"] = "least_load"
    prefix_chars: int = Field(256, ge=1)  # how much of the prompt's start the hash reads
    load_bound: float = Field(1.25, ge=1.0)
    kind: Literal["sluice", "openai"] = "openai"
    upstream_model: str | None = None
    # auto | upstream (its /v1/tokenize) | bytes (UTF-8 upper bound) | local:PATH | local:tiny
    tokenizer: str = "auto"
    versions: StaticVersions | None = None
    supports: list[str] | None = None
    api_key_env: str | None = None  # name of the env var holding the upstream's bearer key
    max_connections: int = Field(1024, ge=1)
    capacity: Capacity = Capacity()  # for `openai` upstreams; unlimited when unset
    # in-flight worst-case tokens may reach kv_tokens × overcommit (worst cases rarely all
    # happen: most answers stop before max_tokens; the engine preempts if they do)
    overcommit: float = Field(1.0, gt=0)
    # What an image / an audio part costs (gateway/media.py); unset: the model takes none.
    image_tokens: Annotated[int, Field(ge=0, le=1_000_000)] | ImageTokens | None = None
    audio_tokens: int | None = Field(None, ge=0, le=1_000_000)

    @property
    def media(self) -> MediaCosts:
        """Its image and audio prices (``Upstream.media`` keeps them)."""
        image = self.image_tokens
        rule = (None if image is None else ImageRule(image) if isinstance(image, int)
                else ImageRule(image.fixed, image.per_tile, image.tile, image.fit,
                               image.short_side))
        return MediaCosts(rule, self.audio_tokens)

    @field_validator("name")
    @classmethod
    def _no_at(cls, v: str) -> str:
        if "@" in v or v != v.strip():
            raise ValueError("a model name may not contain '@' (it separates the revision pin) "
                             "or surrounding spaces")
        return v

    @model_validator(mode="before")
    @classmethod
    def _pool(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("upstreams") is None:
            return data
        members = [{"url": m} if isinstance(m, str) else m for m in data["upstreams"]]
        if not members:
            raise ValueError("upstreams must list at least one server")
        if data.get("upstream") is not None:
            raise ValueError("give either upstream (one server) or upstreams (a pool)")
        first = members[0]
        return {**data, "upstreams": members,
                "upstream": first.get("url") if isinstance(first, dict) else first}

    @field_validator("upstream")
    @classmethod
    def _url(cls, v: str) -> str:
        return _base_url(v)

    @property
    def members(self) -> list[MemberEntry]:
        """The pool's servers (one for the ``upstream:`` form), each with its kind set."""
        listed = self.upstreams or [MemberEntry(url=self.upstream)]
        return [m if m.kind else m.model_copy(update={"kind": self.kind}) for m in listed]

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, v: str) -> str:
        if v in ("auto", "upstream", "bytes") or (v.startswith("local:") and len(v) > 6):
            return v
        raise ValueError("tokenizer must be auto, upstream, bytes, local:PATH or local:tiny")

    @field_validator("supports")
    @classmethod
    def _supports(cls, v: list[str] | None) -> list[str] | None:
        unknown = sorted(set(v or ()) - CAPABILITIES)
        if unknown:
            raise ValueError(f"unknown capabilities {unknown}; known: {sorted(CAPABILITIES)}")
        return v

    @property
    def capabilities(self) -> frozenset[str]:
        if self.supports is not None:
            return frozenset(self.supports)
        return SLUICE_CAPABILITIES if self.kind == "sluice" else OPENAI_CAPABILITIES

    @property
    def served_name(self) -> str:
        return self.upstream_model or self.name


class StoreConfig(_Strict):
    """Where quotas are kept: in this process (one replica), or Redis (shared by replicas)."""

    url: str | None = None  # redis://host:port/db; None: in-memory (one process only)
    timeout_s: float = Field(0.25, gt=0)  # every store call; past it the fail mode applies
    replicas: int = Field(1, ge=1)  # gateway replicas: fail-open admits limit / replicas
    # url names one seed node of a Redis Cluster (docs/admission.md "Redis Cluster")
    cluster: bool = False

    @field_validator("url")
    @classmethod
    def _redis(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^rediss?://", v):
            raise ValueError("store.url must be a redis:// or rediss:// URL")
        return v

    @model_validator(mode="after")
    def _cluster_needs_url(self) -> StoreConfig:
        if self.cluster and self.url is None:
            raise ValueError("store.cluster needs store.url (a seed node of the cluster)")
        if self.cluster and self.url is not None \
                and urlsplit(self.url).path not in ("", "/", "/0"):
            raise ValueError("store.url: a Redis Cluster has database 0 only")
        return self


class AdmissionConfig(_Strict):
    lease_ttl_s: float = Field(30.0, gt=0)  # a dead replica's leases expire after this
    # The worst case reserved for a request without max_tokens on a model whose context
    # length is unknown; settlement charges what was really generated.
    default_max_tokens: int = Field(4096, ge=1)


class AdminConfig(_Strict):
    """The tenant admin API (/admin/v1; its key is the env var SLUICE_ADMIN_KEY) and the
    live tenant registry behind it."""

    # how often each replica reads the tenant store's version (a change reloads every record)
    poll_interval_s: float = Field(0.25, gt=0, le=1.0)


class QueueConfig(_Strict):
    max_len: int = Field(1024, ge=0)  # waiting requests per upstream; more get 503
    aging_s: float = Field(5.0, gt=0)  # a waiting request's class improves by 1 every aging_s
    # Share of each upstream's sequences and KV tokens that only requests with priority <=
    # reserve_priority may use (gateway/queue.py); 0 turns the reserve off.
    reserve_share: float = Field(0.0, ge=0, lt=1)
    reserve_priority: int = 0


class TokenizeConfig(_Strict):
    """The pool a ``local:`` tokenizer tokenizes long prompts in (protocol/offload.py):
    threads, fair across tenants; 429 past a tenant's share, 503 when the queue is full."""

    workers: int = Field(2, ge=1, le=64)  # threads tokenizing at once
    per_tenant: int = Field(8, ge=1)  # one tenant's tokenizations running or waiting
    max_waiting: int = Field(64, ge=0)  # waiting for a thread, all tenants together
    inline_chars: int = Field(8192, ge=0)  # a prompt under this is tokenized on the loop
    trim_chars: int = Field(1 << 20, ge=0)  # after one this large, give memory back

    def settings(self) -> OffloadSettings:
        return OffloadSettings(workers=self.workers, per_tenant=self.per_tenant,
                               max_waiting=self.max_waiting, inline_chars=self.inline_chars,
                               trim_chars=self.trim_chars)


class BreakerConfig(_Strict):
    """Circuit breaker per upstream server (policies/breaker.py)."""

    consecutive_failures: int = Field(5, ge=1)
    failure_rate: float = Field(0.5, gt=0, le=1)
    window_s: float = Field(10.0, gt=0)
    min_requests: int = Field(20, ge=1)
    cooldown_s: float = Field(5.0, ge=0)
    max_probes: int = Field(1, ge=1)
    # after half-open -> closed, dispatch to the member is paced this long (0: off),
    # from ramp_start_rps, doubling each tenth of it (docs/resilience.md)
    ramp_s: float = Field(10.0, ge=0)
    ramp_start_rps: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _ramp(self) -> BreakerConfig:
        if self.ramp_s > 0 and self.ramp_start_rps * self.ramp_s / RAMP_STEPS < 1:
            raise ValueError(f"ramp_start_rps × ramp_s / {RAMP_STEPS} must be at least 1 (a "
                             "ramp step must let one request through)")
        return self


class RetryConfig(_Strict):
    """Retries on another server of the pool, before any byte reached the client."""

    max_attempts: int = Field(3, ge=1)
    budget_ratio: float = Field(0.1, ge=0, le=1)  # extra load from retries, at most
    budget_min_per_s: float = Field(0.2, ge=0)
    backoff_base_s: float = Field(0.02, ge=0)
    backoff_max_s: float = Field(0.5, ge=0)


class ResilienceConfig(_Strict):
    breaker: BreakerConfig = BreakerConfig()
    retry: RetryConfig = RetryConfig()


class GatewayConfig(_Strict):
    listen: Listen = Listen()
    resilience: ResilienceConfig = ResilienceConfig()
    queue: QueueConfig = QueueConfig()
    store: StoreConfig = StoreConfig()
    admission: AdmissionConfig = AdmissionConfig()
    admin: AdminConfig = AdminConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    tenants_file: Path = Path("tenants.yaml")
    models: list[ModelEntry] = Field(min_length=1)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    refresh_interval_s: float = Field(10.0, gt=0)
    timeouts: Timeouts = Timeouts()
    shutdown_timeout_s: float = Field(30.0, ge=0)  # in-flight requests may finish this long
    # after SIGTERM: /readyz 503 and new requests 503 this long before the listener closes
    drain_grace_s: float = Field(0.0, ge=0)
    telemetry: TelemetryConfig = TelemetryConfig()  # the OTEL_* environment wins over it

    def connection_limits(self) -> ConnectionLimits:
        """What the listener enforces on client connections (protocol.server)."""
        return ConnectionLimits(request_read_s=self.timeouts.request_read_s,
                                body_min_bytes_per_s=self.timeouts.body_min_bytes_per_s,
                                max_connections=self.listen.max_connections)

    @model_validator(mode="after")
    def _unique_names(self) -> GatewayConfig:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {dupes}")
        return self


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        # libyaml's loader where PyYAML has it: 10x faster on a large tenants file
        return yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc


def _describe(exc: ValidationError, path: Path) -> str:
    lines = [f"{path}: invalid configuration"]
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err.get("loc", ())) or "(top level)"
        lines.append(f"  {where}: {err.get('msg')}")
    return "\n".join(lines)


def apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """``SLUICE_A__B=v`` sets ``raw["a"]["b"] = yaml(v)``; list-valued keys are not addressable."""
    out = dict(raw)
    for name, value in env.items():
        if name == "SLUICE_REDIS_URL":
            out["store"] = {**(out.get("store") or {}), "url": value or None}
            continue
        if name == "SLUICE_REDIS_CLUSTER":  # 1/true/yes/on, 0/false/no/off/empty; else refused
            out["store"] = {**(out.get("store") or {}), "cluster": value.strip() or False}
            continue
        if not name.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
        if not path or path[0] not in GatewayConfig.model_fields or path[0] == "models":
            continue
        node = out
        for part in path[:-1]:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, dict) else {}
            node = node[part]
        node[path[-1]] = yaml.safe_load(value) if value else value
    return out


def load_gateway_config(path: str | Path, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read and validate ``gateway.yaml``; ``tenants_file`` becomes absolute (relative to it)."""
    path = Path(path)
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    raw = apply_env(raw, os.environ if env is None else env)
    try:
        cfg = GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from None
    if not cfg.tenants_file.is_absolute():
        cfg = cfg.model_copy(update={"tenants_file": (path.parent / cfg.tenants_file).resolve()})
    return cfg


def load_tenants(path: str | Path) -> TenantsFile:
    path = Path(path)
    raw = _read_yaml(path)
    try:
        return TenantsFile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from None
