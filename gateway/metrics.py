"""The gateway's Prometheus metrics (text exposition, rendered on demand)."""

from __future__ import annotations

from collections.abc import Iterable

from .upstream import Upstream
from .usage import UsageLedger

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**kv: str) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in kv.items()) + "}"


class GatewayMetrics:
    def __init__(self) -> None:
        self.responses: dict[tuple[str, str, str], int] = {}  # (route, tenant, status)
        self.inflight = 0
        self.clamped: dict[str, int] = {}

    def observe_response(self, route: str, tenant: str, status: int) -> None:
        key = (route, tenant, str(status))
        self.responses[key] = self.responses.get(key, 0) + 1

    def render(self, ledger: UsageLedger, upstreams: Iterable[Upstream]) -> str:
        out: list[str] = [
            "# HELP sluice_gateway_responses_total Responses sent, by route, tenant and status.",
            "# TYPE sluice_gateway_responses_total counter",
        ]
        for (route, tenant, status), n in sorted(self.responses.items()):
            out.append(f"sluice_gateway_responses_total"
                       f"{_labels(route=route, tenant=tenant, status=status)} {n}")
        out += ["# HELP sluice_gateway_inflight_requests Generation requests in flight.",
                "# TYPE sluice_gateway_inflight_requests gauge",
                f"sluice_gateway_inflight_requests {self.inflight}",
                "# HELP sluice_gateway_requests_settled_total Settled generation requests.",
                "# TYPE sluice_gateway_requests_settled_total counter"]
        for (tenant, model, outcome), n in sorted(ledger.by_key.items()):
            out.append(f"sluice_gateway_requests_settled_total"
                       f"{_labels(tenant=tenant, model=model, outcome=outcome)} {n}")
        out += ["# HELP sluice_gateway_tokens_total Settled tokens per tenant.",
                "# TYPE sluice_gateway_tokens_total counter"]
        for tenant, usage in sorted(ledger.by_tenant.items()):
            out.append(f"sluice_gateway_tokens_total{_labels(tenant=tenant, type='prompt')} "
                       f"{usage.prompt_tokens}")
            out.append(f"sluice_gateway_tokens_total{_labels(tenant=tenant, type='completion')}"
                       f" {usage.completion_tokens}")
        out += ["# HELP sluice_gateway_upstream_ready Whether the upstream's versions are known.",
                "# TYPE sluice_gateway_upstream_ready gauge"]
        for up in upstreams:
            out.append(f"sluice_gateway_upstream_ready{_labels(model=up.name)} "
                       f"{1 if up.ready else 0}")
        return "\n".join(out) + "\n"
