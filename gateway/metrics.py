"""The gateway's Prometheus metrics (text exposition, rendered on demand)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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

    def observe_response(self, route: str, tenant: str, status: int) -> None:
        key = (route, tenant, str(status))
        self.responses[key] = self.responses.get(key, 0) + 1

    def render(self, ledger: UsageLedger, upstreams: Iterable[Upstream],
               queues: dict[str, Any], admission: Any) -> str:
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
        out += ["# HELP sluice_gateway_queue_length Requests waiting for upstream capacity.",
                "# TYPE sluice_gateway_queue_length gauge"]
        out += [f"sluice_gateway_queue_length{_labels(model=n)} {q.size}"
                for n, q in sorted(queues.items())]
        out += ["# HELP sluice_gateway_slots_held Upstream slots this replica holds.",
                "# TYPE sluice_gateway_slots_held gauge"]
        out += [f"sluice_gateway_slots_held{_labels(model=n)} {len(q.held)}"
                for n, q in sorted(queues.items())]
        out += ["# HELP sluice_gateway_dispatched_total Requests dispatched from the queue.",
                "# TYPE sluice_gateway_dispatched_total counter"]
        for n, q in sorted(queues.items()):
            for tenant, count in sorted(q.dispatched.items()):
                out.append(f"sluice_gateway_dispatched_total"
                           f"{_labels(model=n, tenant=tenant)} {count}")
        out += ["# HELP sluice_gateway_rejects_total Requests refused by a tenant limit.",
                "# TYPE sluice_gateway_rejects_total counter"]
        for (tenant, limit), n in sorted(admission.rejects.items()):
            out.append(f"sluice_gateway_rejects_total{_labels(tenant=tenant, limit=limit)}"
                       f" {n}")
        out += [("# HELP sluice_gateway_fail_open_total Requests admitted by the local share "
                "while the quota store was unreachable."),
                "# TYPE sluice_gateway_fail_open_total counter"]
        for tenant, n in sorted(admission.fail_open.items()):
            out.append(f"sluice_gateway_fail_open_total{_labels(tenant=tenant)} {n}")
        out += ["# HELP sluice_gateway_store_errors_total Quota store calls that failed.",
                "# TYPE sluice_gateway_store_errors_total counter",
                f"sluice_gateway_store_errors_total {admission.store_errors}",
                "# HELP sluice_gateway_leases_live Quota leases held by this replica.",
                "# TYPE sluice_gateway_leases_live gauge",
                f"sluice_gateway_leases_live {len(admission.live)}"]
        return "\n".join(out) + "\n"
