"""The resolve stage alone: a body becomes a frozen ``Prepared`` (or a 4xx naming why),
against a real upstream entry whose versions come from the config (no network)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.contract import parse
from gateway.errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    PermissionDenied,
    RevisionMismatch,
    RevisionUnavailable,
)
from gateway.resolve import Prepared, Resolver
from gateway.tenants import Tenant
from tests.gateway.stage_kit import VERSIONS, config, gateway, tenant


def resolver(**extra: Any) -> Resolver:
    gw = gateway(config(**extra), {})
    return gw.resolver


async def prepare(r: Resolver, body: dict[str, Any], who: Tenant | None = None,
                  deadline_ms: int | None = None) -> Prepared:
    who = who or tenant()
    req = parse("chat", body)
    target = await r.target(req, who)
    return await r.prepare("chat", req, body, target, who, "rid", deadline_ms)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


async def test_a_prepared_request_is_frozen_and_carries_the_worst_case() -> None:
    r = resolver(supports=["priority", "cache_salt"])
    p = await prepare(r, {**CHAT, "max_tokens": 50, "priority": 3, "deadline_ms": 5000})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.priority = 1  # type: ignore[misc]
    assert p.worst_case == p.prompt_tokens + 50 and not p.prompt_exact  # bytes upper bound
    assert p.stamp.versions.revision == VERSIONS.revision
    assert p.body["model"] == "fake-model" and "deadline_ms" not in p.body
    assert p.body["priority"] == 3 and p.body["cache_salt"] == r.salter.salt(p.tenant.id)
    assert p.deadline is not None and p.path == "/v1/chat/completions"


@pytest.mark.parametrize(("kind", "extra", "sequences"), [
    ("chat", {}, 1), ("chat", {"n": 1}, 1), ("chat", {"n": 4}, 4), ("chat", {"n": 16}, 16),
    ("completion", {"n": 2}, 2), ("completion", {"best_of": 3}, 3),
    ("completion", {"n": 2, "best_of": 5}, 5),
])
async def test_the_worst_case_counts_every_sequence_generated(
        kind: str, extra: dict[str, Any], sequences: int) -> None:
    r = resolver(supports=["n", "best_of"])
    who = tenant()
    body: dict[str, Any] = {**(CHAT if kind == "chat" else {"model": "m", "prompt": "hi"}),
                            "max_tokens": 500, **extra}
    req = parse(kind, body)  # type: ignore[arg-type]
    p = await r.prepare(kind, req, body, await r.target(req, who), who,  # type: ignore[arg-type]
                        "rid", None)
    assert p.worst_case == p.prompt_tokens + sequences * 500
    many = f"{sequences} × " if sequences > 1 else ""
    assert p.worst_terms == f"prompt {p.prompt_tokens} + {many}max_tokens 500 = {p.worst_case}"
    assert p.body.get("n") == extra.get("n")  # forwarded as asked


async def test_unknown_models_and_pins_are_refused() -> None:
    r = resolver()
    with pytest.raises(ModelNotFound):
        await prepare(r, {**CHAT, "model": "nope"})
    with pytest.raises(BadRequest):
        await prepare(r, {**CHAT, "model": "m@"})
    with pytest.raises(RevisionUnavailable) as unavailable:  # no member serves it now
        await prepare(r, {**CHAT, "model": "m@deadbeef"})
    assert unavailable.value.status == 503 and unavailable.value.retry_after_s == 3600
    with pytest.raises(RevisionMismatch):  # too short to be a revision's prefix
        await prepare(r, {**CHAT, "model": "m@rrrrrr"})
    p = await prepare(r, {**CHAT, "model": "m@" + VERSIONS.revision[:8]})
    assert p.pin == VERSIONS.revision[:8]


async def test_the_tenants_range_bounds_priority() -> None:
    with pytest.raises(PermissionDenied):
        await prepare(resolver(), {**CHAT, "priority": 11})


async def test_max_tokens_is_clamped_or_refused_by_the_tenants_cap() -> None:
    r = resolver()
    p = await prepare(r, {**CHAT, "max_tokens": 900}, tenant(max_tokens=100, on_exceed="clamp"))
    assert p.max_tokens == 100 and p.body["max_tokens"] == 100
    assert p.clamped == "max_tokens=100; requested=900"
    unset = await prepare(r, CHAT, tenant(max_tokens=100))
    assert unset.body["max_tokens"] == 100 and unset.clamped == "max_tokens=100; requested=unset"
    with pytest.raises(BadRequest) as refused:
        await prepare(r, {**CHAT, "max_tokens": 900}, tenant(max_tokens=100))
    assert refused.value.code == "max_tokens_over_limit"


async def test_a_prompt_over_the_tenants_cap_is_a_413() -> None:
    with pytest.raises(GatewayError) as caught:
        await prepare(resolver(), {**CHAT, "messages": [{"role": "user", "content": "x" * 500}]},
                      tenant(max_prompt_tokens=100))
    assert caught.value.status == 413 and caught.value.code == "prompt_too_long"


async def test_the_gateways_total_timeout_bounds_the_deadline() -> None:
    r = resolver()
    r.config = r.config.model_copy(update={"timeouts": r.config.timeouts.model_copy(
        update={"total_s": 2.0})})
    now = r.clock()
    long = await prepare(r, CHAT, deadline_ms=60_000)
    assert long.total_timeout and long.deadline is not None and long.deadline - now < 3
    short = await prepare(r, CHAT, deadline_ms=500)
    assert not short.total_timeout


async def test_features_the_upstream_lacks_are_refused_naming_the_field() -> None:
    with pytest.raises(BadRequest) as caught:
        await prepare(resolver(), {**CHAT, "top_k": 5})
    assert caught.value.param == "top_k" and caught.value.code == "unsupported_parameter"


async def test_streams_always_ask_the_upstream_for_usage() -> None:
    p = await prepare(resolver(), {**CHAT, "stream": True})
    assert p.stream and not p.client_usage and p.body["stream_options"] == {
        "include_usage": True}
