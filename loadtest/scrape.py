"""Scrape the target's Prometheus ``/metrics`` on the run's own timeline.

Queue depth, KV use, preemptions and rejects explain the client-side curves (a TTFT tail is
a queue; a goodput cliff is KV running out). Each scrape is stamped on the client's clock,
relative to the run's start, so the timeline plot lines them up with the send rate.
A target without ``/metrics`` (OpenAI itself) just yields no samples: never an error.

Known series: Sluice's gateway and bundled backend, and vLLM's names, so the same report
works against either. A bundled backend's ``/metrics`` needs its API key: ``keys`` maps a
base URL to the bearer key sent there (to no other URL).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

INTERVAL_S = 1.0
# metric name -> timeline field; several names may feed one field (summed per scrape)
SERIES: dict[str, str] = {
    "sluice_gateway_queue_length": "queue",
    "sluice_backend_num_requests_waiting": "queue_backend",
    "vllm:num_requests_waiting": "queue_backend",
    "sluice_gateway_inflight_requests": "running",
    "sluice_backend_num_requests_running": "running_backend",
    "vllm:num_requests_running": "running_backend",
    "sluice_backend_kv_cache_usage_ratio": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "sluice_backend_preemptions_total": "preemptions",
    "vllm:num_preemptions_total": "preemptions",
}
FIELDS = ("queue", "queue_backend", "running", "running_backend", "kv_usage", "preemptions",
          "rejects")
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_STATUS = re.compile(r'status="(\d+)"')


@dataclass(slots=True, frozen=True)
class Sample:
    t: float  # seconds from the run's start
    url: str
    values: dict[str, float]


def parse(text: str) -> dict[str, float]:
    """The timeline fields present in one exposition (rejects: 429 + 503 responses)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if name == "sluice_gateway_responses_total":
            out.setdefault("rejects", 0.0)
            s = _STATUS.search(labels or "")
            if s is not None and s.group(1) in ("429", "503"):
                out["rejects"] = out.get("rejects", 0.0) + value
            continue
        field = SERIES.get(name)
        if field is not None:
            out[field] = out.get(field, 0.0) + value
    return out


class Scraper:
    """Polls each URL every INTERVAL_S until stopped; keeps what it could read."""

    def __init__(self, base_urls: list[str], interval_s: float = INTERVAL_S,
                 keys: Mapping[str, str] | None = None) -> None:
        self.urls = [u.rstrip("/") + "/metrics" for u in base_urls]
        self.interval_s = interval_s
        self.headers = {u.rstrip("/") + "/metrics": {"authorization": f"Bearer {k}"}
                        for u, k in (keys or {}).items()}
        self.samples: list[Sample] = []
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self, start: float) -> None:
        if not self.urls:
            return
        dead: set[str] = set()
        async with httpx.AsyncClient(timeout=2.0) as client:
            while not self._stop.is_set():
                for url in self.urls:
                    if url in dead:
                        continue
                    try:
                        resp = await client.get(url, headers=self.headers.get(url))
                    except httpx.HTTPError:
                        continue
                    if resp.status_code == 404:
                        dead.add(url)  # no /metrics there: stop asking
                        continue
                    if resp.status_code == 200:
                        self.samples.append(Sample(time.perf_counter() - start, url,
                                                   parse(resp.text)))
                try:
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
                except TimeoutError:
                    pass
