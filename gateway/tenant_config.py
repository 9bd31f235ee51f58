"""A tenant's policy, as ``tenants.yaml`` and the admin API give it, validated strictly.

``TenantEntry`` checks the tenants file at start, every admin API write before it reaches
the store (what it refuses is never stored), and every record read back from the store (one
it refuses, written by an older version or by hand, is logged and left out: never a 500).

Limits (docs/admin.md#limits). Every number is finite (no NaN, no Infinity); every count is
a JSON integer (not 5.0, "5" or true); every string is valid Unicode (no lone surrogate)
without control characters.

    id                      TENANT_ID: 1-64 of A-Z a-z 0-9 _ . -, a letter or digit first
    name                    at most 256 characters
    keys (file only)        "sha256:" + 64 lowercase hex digits
    models                  at most 1024 entries, each "*" or a model name: 1-256
                            characters, no "@", no surrounding whitespace
    quotas                  tokens_* and requests_per_minute 0..10**15 (MAX_QUOTA);
                            max_concurrency, max_queued 0..10**6 (MAX_COUNT)
    caps                    max_body_bytes 1..2**40; max_prompt_tokens, max_tokens 1..10**9
    priority                min <= default <= max, each within ±10**6 (MAX_PRIORITY)
    weight                  0.001..10**6
    degrade                 batch_priority within ±10**6; clamp_at, shed_batch_at,
                            fallback.at in (0, 1000]; clamp_max_tokens 1..10**9;
                            fallback.model a model name
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    model_validator,
)

TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # fullmatch
KEY_HASH = re.compile(r"sha256:[0-9a-f]{64}")  # fullmatch
MAX_QUOTA = 10**15  # tokens or requests per period; a Lua number (a double) holds it exactly
MAX_COUNT = 10**6  # requests at once, or waiting
MAX_PRIORITY = 10**6
MAX_TOKENS = 10**9  # one request's prompt or completion
MAX_BODY_BYTES = 2**40
MAX_TEXT = 256
MAX_MODELS = 1024
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e6
MAX_LOAD = 1000.0

# a lone surrogate, or a C0/C1 control character
_BAD_CHAR = re.compile("[\ud800-\udfff\x00-\x1f\x7f-\x9f]")


def describe(exc: ValidationError) -> tuple[str | None, str]:
    """The first field's dotted path, and every error as ``path: message``; lone surrogates
    (a key of a bad stored record) escaped, so the text can be logged and sent."""
    errors = exc.errors(include_url=False)
    paths = [_path(e.get("loc", ())) for e in errors]
    detail = "; ".join(f"{path or 'body'}: {e['msg']}" for path, e in zip(paths, errors,
                                                                           strict=True))
    return _escaped(paths[0]) or None, _escaped(detail)


def _path(loc: tuple[int | str, ...]) -> str:
    """``("models", 0)`` as ``models[0]``: the JSON path, as protocol.json_body names it."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _text(v: str) -> str:
    bad = _BAD_CHAR.search(v)
    if bad is not None:
        kind = "a lone surrogate" if "\ud800" <= bad.group() <= "\udfff" else \
            "a control character"
        raise ValueError(f"text must be valid Unicode without control characters; "
                         f"found {kind} ({bad.group()!a}) at {bad.start()}")
    return v


def _model_name(v: str) -> str:
    if v != "*" and ("@" in v or v != v.strip() or not v):
        raise ValueError("a model name is '*' or 1-256 characters, without '@' or "
                         "surrounding whitespace")
    return v


def _tenant_id(v: str) -> str:
    if not TENANT_ID.fullmatch(v):
        raise ValueError("a tenant id is 1-64 letters, digits, '_', '.' or '-', a letter or "
                         "digit first")
    return v


def _key_hash(v: str) -> str:
    if not KEY_HASH.fullmatch(v):
        raise ValueError("keys are stored only as 'sha256:<64 lowercase hex>' "
                         "(`sluice hash-key KEY` prints it); never the key itself")
    return v


Text = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_text)]
ModelName = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_text),
                      AfterValidator(_model_name)]
Quota = Annotated[StrictInt, Field(ge=0, le=MAX_QUOTA)]
Count = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
Tokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)]
Priority = Annotated[StrictInt, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)]
Load = Annotated[float, Field(gt=0, le=MAX_LOAD)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PriorityRange(_Strict):
    """Lower is more urgent (vLLM's convention)."""

    min: Priority = 0
    max: Priority = 10
    default: Priority = 5

    @model_validator(mode="after")
    def _ordered(self) -> PriorityRange:
        if not self.min <= self.default <= self.max:
            raise ValueError("priority needs min <= default <= max")
        return self


class Caps(_Strict):
    max_body_bytes: Annotated[StrictInt, Field(ge=1, le=MAX_BODY_BYTES)] | None = None
    max_prompt_tokens: Tokens | None = None
    max_tokens: Tokens | None = None
    # Over the max_tokens cap: refuse with 400, or lower it and say so in x-sluice-clamped.
    on_exceed: Literal["reject", "clamp"] = "reject"


class QuotasConfig(_Strict):
    """Omitted = unlimited."""

    tokens_per_minute: Quota | None = None
    requests_per_minute: Quota | None = None
    tokens_per_day: Quota | None = None
    tokens_per_month: Quota | None = None
    max_concurrency: Count | None = None
    max_queued: Count | None = None


class FallbackConfig(_Strict):
    model: ModelName  # a public model name the tenant may use
    at: Load = 0.9  # from this load of the requested model


class DegradeConfig(_Strict):
    """What a tenant's traffic gives up under overload (policies/degrade.py). Load: the
    model's in-flight plus waiting worst-case tokens ÷ its capacity (this replica's view)."""

    batch_priority: Priority = 7  # priority >= this is the batch class (lower is more urgent)
    clamp_at: Load = 0.8
    clamp_max_tokens: Tokens = 256
    shed_batch_at: Load = 0.95
    fallback: FallbackConfig | None = None


class TenantEntry(_Strict):
    id: Annotated[str, AfterValidator(_tenant_id)]
    name: Text = ""
    keys: list[Annotated[str, AfterValidator(_key_hash)]] = Field(default_factory=list)
    models: list[ModelName] = Field(default_factory=lambda: ["*"], max_length=MAX_MODELS)
    priority: PriorityRange = PriorityRange()
    caps: Caps = Caps()
    quotas: QuotasConfig = QuotasConfig()
    # share of dispatches among tenants of one priority
    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT)
    # closed: 503 while the store is unreachable; open: admit within limit / replicas locally
    fail_mode: Literal["closed", "open"] = "closed"
    degrade: DegradeConfig | None = None  # none: no degradation, only shedding when full


class TenantsFile(_Strict):
    tenants: list[TenantEntry]

    @model_validator(mode="after")
    def _unique(self) -> TenantsFile:
        counts = Counter(t.id for t in self.tenants)  # linear: 100,000 tenants load
        dupes = sorted(i for i, n in counts.items() if n > 1)
        if dupes:
            raise ValueError(f"tenant ids must be unique; repeated: {dupes}")
        seen: dict[str, str] = {}
        for t in self.tenants:
            for key in t.keys:
                if key in seen:
                    raise ValueError(f"one key is listed for tenants {seen[key]!r} and {t.id!r}")
                seen[key] = t.id
        return self
