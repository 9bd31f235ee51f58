"""The first stage of a generation request: from an authenticated body to a ``Prepared``.

    parse      the body against the contract (400 naming the field)
    target     model resolved (404 when unknown or not allowed), the tenant's fallback model
               under load, the versions it is served at (those of a member serving the pin,
               when pinned) snapshotted into the stamp of errors answered before routing;
               the answer itself is stamped with the versions of the member that made it
               (``relay.py``)
    prepare    pin checked (400 revision_mismatch for a pin too short to be one; 503
               revision_unavailable, Retry-After the refresh interval, when no member is
               known to serve it), features checked against what the
               upstream implements, structured-output and tool fields checked (400 naming
               the field; their schema's and tools' hashes are the request's own versions,
               ``structured.py``), priority within the tenant's range (403), prompt tokens
               (tools and schema included) counted and capped (413 / 400
               context_length_exceeded; one that provably
               exceeds either is refused before it is tokenized), max_tokens capped or
               clamped, degradation applied, the deadline fixed, and the exact body the
               upstream will get

A ``Prepared`` is frozen: later stages read it, none changes it. Errors raised by
``prepare`` are answered with the target's stamp (the client learns what it would have got).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from policies.degrade import decide
from protocol.versions import MIN_PIN, SHORT, ResolvedVersions, ServedVersions

from .cache_salt import CacheSalter
from .config import GatewayConfig
from .contract import ChatRequest, Kind, Request, check_capabilities
from .errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    PayloadTooLarge,
    PermissionDenied,
    RevisionMismatch,
    RevisionUnavailable,
    ServiceUnavailable,
)
from .structured import NO_EXTRAS, chat_extras
from .tenants import Tenant
from .tokens import OverLimit
from .upstream import Upstream, UpstreamError

UNREACHABLE_RETRY_AFTER_S = 1.0
_STAMPS_KEPT = 4096


@dataclass(slots=True, frozen=True)
class Target:
    """The upstream a request goes to and the versions it will be answered with."""

    upstream: Upstream
    stamp: ResolvedVersions
    pin: str | None  # the revision the client pinned, if any
    fallback: str | None  # x-sluice-degraded when the tenant's fallback model was chosen


@dataclass(slots=True, frozen=True)
class Prepared:
    kind: Kind
    request_id: str
    tenant: Tenant
    upstream: Upstream
    stamp: ResolvedVersions
    stream: bool
    client_usage: bool  # the client asked for the usage chunk
    client_continuous: bool  # … and for running usage on every chunk
    priority: int
    prompt_tokens: int  # exact, or the documented upper bound for a byte-counted model
    prompt_exact: bool
    max_tokens: int | None  # the limit the upstream gets (None: the upstream's default)
    body: Mapping[str, Any]  # what the upstream gets
    worst_case: int  # prompt + sequences × the most each may generate: what is reserved
    pin: str | None = None
    clamped: str | None = None  # x-sluice-clamped value
    deadline: float | None = None  # monotonic time the client gives up at
    total_timeout: bool = False  # the deadline is the gateway's timeouts.total_s
    degraded: str | None = None  # x-sluice-degraded: the degradation applied, if any
    prefix_key: bytes | None = None  # what prefix-affine routing hashes
    worst_terms: str = ""  # how worst_case was computed, for refusals and traces
    # the request's own versions: {"schema": sha256, "tools": sha256} of their canonical JSON
    # (full hex), the present ones; stamped after the server's (``client_io.stamp_headers``)
    request_versions: Mapping[str, str] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


@dataclass(slots=True, frozen=True)
class PromptLimit:
    """How many prompt tokens a request may have, and the error past it: the one rule. The
    counters get ``most`` and refuse early (``OverLimit``) what provably exceeds it; the
    error for any count over it is ``refusal``'s."""

    field: str  # "messages" or "prompt": what the error names
    cap: int | None  # the tenant's max_prompt_tokens
    context: int | None  # the model's max_model_len, where counts are exact
    estimated: bool  # the count is an upper bound (ByteCounter)

    @classmethod
    def of(cls, kind: Kind, up: Upstream, tenant: Tenant) -> PromptLimit:
        exact = up.counter.exact
        return cls("messages" if kind == "chat" else "prompt", tenant.caps.max_prompt_tokens,
                   up.max_model_len if exact else None, not exact)

    @property
    def most(self) -> int | None:
        """The largest count allowed (None: no limit): within the cap, below the context."""
        bounds = [n for n in (self.cap, None if self.context is None else self.context - 1)
                  if n is not None]
        return min(bounds, default=None)

    def check(self, tokens: int) -> None:
        most = self.most
        if most is not None and tokens > most:
            raise self.refusal(tokens)

    def refusal(self, tokens: int, at_least: bool = False) -> GatewayError:
        """The error for a prompt of ``tokens`` (more than ``most``): 413 prompt_too_long
        over the tenant's cap, else 400 context_length_exceeded."""
        has = f"at least {tokens}" if at_least else f"{tokens}"
        if self.context is None or (self.cap is not None and tokens > self.cap):
            how = " (an upper bound: this model's tokens are estimated from UTF-8 bytes)" \
                if self.estimated else ""
            return PayloadTooLarge(f"the prompt has {has} tokens{how}; your limit is "
                                   f"{self.cap}", self.field, code="prompt_too_long")
        return BadRequest(f"this model's maximum context length is {self.context} tokens; "
                          f"the prompt has {has}", self.field, code="context_length_exceeded")


class Resolver:
    """Model resolution and request preparation; ``refresh`` re-reads an upstream's
    versions (shared by concurrent callers), ``load`` is an upstream's load for the
    degradation rules."""

    def __init__(self, config: GatewayConfig, upstreams: Mapping[str, Upstream],
                 refresh: Callable[[Upstream], Awaitable[None]],
                 load: Callable[[Upstream], float],
                 clock: Callable[[], float] = time.monotonic,
                 salter: CacheSalter | None = None) -> None:
        self.config = config
        self.upstreams = upstreams
        self.refresh = refresh
        self.load = load
        self.clock = clock
        # the tenant's cache_salt: an HMAC under the gateway's key (gateway/cache_salt.py)
        self.salter = salter or CacheSalter.for_process()
        # one stamp per (model, tenant policy) while the versions stay: it computes its
        # fingerprint and header once, not per request
        self._stamps: dict[tuple[str, str, str], ResolvedVersions] = {}

    # ---- target -------------------------------------------------------------------------
    async def target(self, req: Request, tenant: Tenant) -> Target:
        up, pin = self.resolve_model(tenant, req.model)
        up, fallback = self._fallback(tenant, req.priority, up, pin)
        versions = await self.versions_of(up)
        if pin is not None:  # a member serving the pin, if any; ``prepare`` refuses if none
            versions = next((m.versions for m in up.router.serving(pin) if m.versions),
                            versions)
        return Target(up, self._stamp(up.name, versions, tenant.policy_version), pin, fallback)

    def _stamp(self, model: str, versions: ServedVersions, policy: str) -> ResolvedVersions:
        key = (model, policy, versions.revision)  # a pool mid-upgrade serves two at once
        stamp = self._stamps.get(key)
        if stamp is None or (stamp.versions is not versions and stamp.versions != versions):
            if len(self._stamps) >= _STAMPS_KEPT:
                self._stamps.clear()  # policies edited many times: start again
            stamp = self._stamps[key] = ResolvedVersions(model, versions, policy)
        return stamp

    def resolve_model(self, tenant: Tenant, model: str) -> tuple[Upstream, str | None]:
        name, sep, pin = model.partition("@")
        if sep and not pin:
            raise BadRequest("a version pin is 'name@revision'; the revision is empty", "model",
                             code="invalid_value")
        up = self.upstreams.get(name)
        if up is None or not tenant.may_use(name):
            # Unknown and not-allowed look the same from outside: 404, naming what is allowed.
            allowed = sorted(n for n in self.upstreams if tenant.may_use(n))
            raise ModelNotFound(f"the model {name!r} does not exist or you do not have access "
                                f"to it; your models: {allowed}", "model")
        return up, (pin if sep else None)

    async def versions_of(self, up: Upstream) -> ServedVersions:
        if up.versions is None:
            try:
                await self.refresh(up)
            except UpstreamError as exc:
                raise ServiceUnavailable(f"the model {up.name!r} is not reachable right now",
                                         retry_after_s=UNREACHABLE_RETRY_AFTER_S) from exc
        if up.versions is None:
            raise ServiceUnavailable(f"the model {up.name!r} reports no versions yet",
                                     retry_after_s=UNREACHABLE_RETRY_AFTER_S)
        return up.versions

    def revision_unavailable(self, up: Upstream, pin: str) -> RevisionUnavailable:
        """503 for a pin no member is known to serve now: mid-upgrade, one may again (or
        for the first time) by the next refresh of the members' versions."""
        served = sorted({m.versions.revision[:SHORT] for m in up.members if m.versions})
        wait = self.config.refresh_interval_s
        return RevisionUnavailable(f"no server of the model {up.name!r} serves revision "
                                   f"{pin!r} now (they serve {served}); the servers' versions "
                                   f"are read again within {wait:g} s", "model",
                                   retry_after_s=wait)

    def _fallback(self, tenant: Tenant, asked: int | None, up: Upstream,
                  pin: str | None) -> tuple[Upstream, str | None]:
        """The tenant's fallback model instead of ``up`` when ``up`` is overloaded."""
        rules = tenant.degrade
        if rules is None or rules.fallback_model is None or rules.fallback_model == up.name:
            return up, None
        fb = self.upstreams.get(rules.fallback_model)
        if fb is None or not tenant.may_use(fb.name):
            return up, None
        priority = tenant.priority.default if asked is None else asked
        d = decide(rules, priority, self.load(up), None, pinned=pin is not None)
        if d is None or d.action != "fallback":
            return up, None
        return fb, d.describe(model=up.name)

    # ---- prepare ------------------------------------------------------------------------
    async def prepare(self, kind: Kind, req: Request, body: Mapping[str, Any], target: Target,
                      tenant: Tenant, request_id: str,
                      header_deadline_ms: int | None) -> Prepared:
        up, stamp, pin = target.upstream, target.stamp, target.pin
        versions = stamp.versions
        if pin is not None and not versions.revision_matches(pin):
            if len(pin) < MIN_PIN:  # never a prefix: no member could serve it
                raise RevisionMismatch(versions.pin_refusal(up.name, pin))
            raise self.revision_unavailable(up, pin)
        check_capabilities(req, up.name, up.capabilities)
        extras = (chat_extras(req, bundled=up.entry.kind == "sluice")
                  if isinstance(req, ChatRequest) else NO_EXTRAS)

        pr = tenant.priority
        priority = pr.default if req.priority is None else req.priority
        if not pr.min <= priority <= pr.max:
            raise PermissionDenied(f"priority {priority} is outside your range "
                                   f"[{pr.min}, {pr.max}] (lower is more urgent)", "priority")

        payload: Any = req.messages if isinstance(req, ChatRequest) else req.prompt
        limit = PromptLimit.of(kind, up, tenant)
        text, media = (up.media.split(payload) if isinstance(req, ChatRequest)
                       else (payload, 0))  # images and audio at their declared cost
        try:
            most = None if limit.most is None else max(0, limit.most - media)
            prompt_tokens = media + await up.counter.count(kind, text, extras,
                                                           tenant=tenant.id, limit=most)
        except OverLimit as over:  # refused before encoding: provably over ``limit.most``
            raise limit.refusal(media + over.at_least, at_least=True) from None
        limit.check(prompt_tokens)

        out = dict(body)
        out["model"] = up.served_name
        out.pop("deadline_ms", None)
        out.pop("priority", None)
        if "priority" in up.capabilities:
            out["priority"] = priority
        if "cache_salt" in up.capabilities:
            out["cache_salt"] = self.salter.salt(tenant.id)
        max_tokens, clamped = _limit_tokens(req, out, tenant)
        degraded = target.fallback
        if degraded is None and tenant.degrade is not None:
            max_tokens, degraded = self._degrade(tenant, priority, up, max_tokens, out)
        stream = bool(req.stream)
        opts = req.stream_options
        if stream:
            # Always ask for usage so the gateway knows exact counts; running counts too where
            # the upstream can, so a cancelled stream still settles exactly.
            wanted: dict[str, Any] = {"include_usage": True}
            if "continuous_usage_stats" in up.capabilities:
                wanted["continuous_usage_stats"] = True
            out["stream_options"] = wanted
        if max_tokens is not None:
            generated, each = max_tokens, "max_tokens"
        elif up.max_model_len is not None and up.counter.exact:
            generated, each = max(1, up.max_model_len - prompt_tokens), "the rest of the context"
        else:
            generated, each = self.config.admission.default_max_tokens, "default_max_tokens"
        sequences = generated_sequences(req)
        worst_case = prompt_tokens + sequences * generated
        many = f"{sequences} × " if sequences > 1 else ""
        terms = f"prompt {prompt_tokens} + {many}{each} {generated} = {worst_case}"
        deadline_ms = req.deadline_ms if req.deadline_ms is not None else header_deadline_ms
        deadline, total_timeout = self._deadline(deadline_ms)
        return Prepared(
            kind=kind, request_id=request_id, tenant=tenant, upstream=up, stamp=stamp,
            stream=stream, client_usage=bool(opts and opts.include_usage),
            client_continuous=bool(opts and opts.continuous_usage_stats), priority=priority,
            prompt_tokens=prompt_tokens, prompt_exact=up.counter.exact, max_tokens=max_tokens,
            body=out, worst_case=worst_case, pin=pin, clamped=clamped,
            deadline=deadline, total_timeout=total_timeout, degraded=degraded,
            prefix_key=up.router.prefix_key(tenant.id, payload), worst_terms=terms,
            request_versions=extras.versions())

    def _degrade(self, tenant: Tenant, priority: int, up: Upstream, max_tokens: int | None,
                 out: dict[str, Any]) -> tuple[int | None, str | None]:
        """Shed (raises 503) or clamp a batch request under load; (max_tokens, note)."""
        if tenant.degrade is None:
            return max_tokens, None
        rules = replace(tenant.degrade, fallback_model=None)
        d = decide(rules, priority, self.load(up), max_tokens)
        if d is None:
            return max_tokens, None
        if d.action == "shed":
            err = ServiceUnavailable(f"the model {up.name!r} is overloaded ({d.load:.0%} of "
                                     f"its capacity): batch requests are shed first",
                                     retry_after_s=1.0, code="degraded_shed")
            err.extra_headers.append((b"x-sluice-degraded", d.describe().encode()))
            raise err
        field_name = "max_completion_tokens" if "max_completion_tokens" in out \
            else "max_tokens"
        out[field_name] = d.max_tokens
        return d.max_tokens, d.describe(asked=max_tokens)

    def _deadline(self, deadline_ms: int | None) -> tuple[float | None, bool]:
        """The client's deadline, or ``timeouts.total_s`` from now if that is sooner;
        (monotonic deadline, whether it is the gateway's total timeout)."""
        now = self.clock()
        total = self.config.timeouts.total_s
        client = None if deadline_ms is None else now + deadline_ms / 1000
        if total is not None and (client is None or now + total < client):
            return now + total, True
        return client, False


def generated_sequences(req: Request) -> int:
    """How many sequences the upstream generates: ``n`` choices, or ``best_of`` candidates
    (completions; at least ``n``) of which it returns ``n``. Each may generate up to
    ``max_tokens``: all of them count in the worst case."""
    n = req.n or 1
    best_of = getattr(req, "best_of", None) or 1
    return max(n, best_of)


def _limit_tokens(req: Request, out: dict[str, Any],
                  tenant: Tenant) -> tuple[int | None, str | None]:
    """Apply the tenant's max_tokens cap to ``out``; returns (limit, clamp note)."""
    field_name = "max_completion_tokens" if req.max_completion_tokens is not None \
        else "max_tokens"
    asked = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    cap = tenant.caps.max_tokens
    if cap is None:
        return asked, None
    if asked is None:
        # Absent means "as much as the context allows" upstream: the cap applies, and the
        # client is told, since the body now says something it did not.
        out["max_tokens"] = cap
        return cap, f"max_tokens={cap}; requested=unset"
    if asked <= cap:
        return asked, None
    if tenant.caps.on_exceed == "reject":
        raise BadRequest(f"{field_name}={asked} is over your limit of {cap}", field_name,
                         code="max_tokens_over_limit")
    out[field_name] = cap
    return cap, f"{field_name}={cap}; requested={asked}"
