"""Degradation under overload: what a tenant's batch traffic gives up before anyone fails.

A tenant's rules (``degrade:`` in tenants.yaml) split its requests into two classes by
priority: ``batch`` (priority ≥ ``batch_priority``, lower is more urgent) and
``interactive``. Given the model's load (in-flight plus waiting worst-case tokens ÷ the
pool's capacity), the first rule that applies wins, in this order:

    fallback   load ≥ fallback_at, a fallback model named: serve it from that model
               (any class; the tenant must be allowed the model; never for a pinned request)
    shed       batch and load ≥ shed_batch_at: refuse with 503 now, so interactive
               requests keep the capacity (interactive is shed only when the queue is full)
    clamp      batch and load ≥ clamp_at: lower max_tokens to clamp_max_tokens

Whatever is applied is stated on the response (``x-sluice-degraded``) and on the trace;
a fallback's answer is stamped with the fallback model's versions. Pure: the caller
measures the load and enforces the decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(slots=True, frozen=True)
class DegradeRules:
    batch_priority: int = 7
    clamp_at: float = 0.8
    clamp_max_tokens: int = 256
    shed_batch_at: float = 0.95
    fallback_model: str | None = None
    fallback_at: float = 0.9


@dataclass(slots=True, frozen=True)
class Degrade:
    action: Literal["fallback", "shed", "clamp"]
    load: float
    max_tokens: int | None = None  # clamp: the new limit
    model: str | None = None  # fallback: the model to use

    def describe(self, asked: int | None = None, model: str | None = None) -> str:
        """The ``x-sluice-degraded`` value."""
        load = f"load={self.load:.2f}"
        if self.action == "clamp":
            return f"clamp; max_tokens={self.max_tokens}; requested={asked}; {load}"
        if self.action == "fallback":
            return f"fallback; model={self.model}; requested={model}; {load}"
        return f"shed; class=batch; {load}"


def decide(rules: DegradeRules, priority: int, load: float, max_tokens: int | None,
           pinned: bool = False) -> Degrade | None:
    """The degradation to apply now, or None."""
    batch = priority >= rules.batch_priority
    if rules.fallback_model is not None and not pinned and load >= rules.fallback_at:
        return Degrade("fallback", load, model=rules.fallback_model)
    if batch and load >= rules.shed_batch_at:
        return Degrade("shed", load)
    if batch and load >= rules.clamp_at and (max_tokens is None
                                              or max_tokens > rules.clamp_max_tokens):
        return Degrade("clamp", load, max_tokens=rules.clamp_max_tokens)
    return None
