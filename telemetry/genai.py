"""The metrics the OpenTelemetry GenAI semantic conventions name, with their bucket
boundaries, as Prometheus histograms named the way the OTel → Prometheus translation names
them (dots to underscores, the unit as a suffix: ``s`` → ``_seconds``, ``{token}`` dropped).

``OTEL`` maps each Prometheus name back to its OTel name, unit and attribute names, so the
OTLP push (``telemetry.push``) sends them as the conventions spell them. An empty label value
means the attribute is absent (``error_type`` on a success, a model not known yet): the
push leaves it out.

Both servers record the server metrics; the gateway, the client of its upstreams, also
records ``gen_ai.client.token.usage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .metrics import Registry

PROVIDER = "sluice"
LABELS = ("gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model")

REQUEST_DURATION = "gen_ai_server_request_duration_seconds"
TIME_TO_FIRST_TOKEN = "gen_ai_server_time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN = "gen_ai_server_time_per_output_token_seconds"
TOKEN_USAGE = "gen_ai_client_token_usage"

# The conventions' advice (ExplicitBucketBoundaries), unchanged.
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_USAGE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                       16777216, 67108864)

_ATTRIBUTES = {"gen_ai_operation_name": "gen_ai.operation.name",
               "gen_ai_provider_name": "gen_ai.provider.name",
               "gen_ai_request_model": "gen_ai.request.model",
               "gen_ai_token_type": "gen_ai.token.type",
               "error_type": "error.type"}


@dataclass(slots=True, frozen=True)
class OtelName:
    """How a Prometheus family is spelled in OTLP."""

    name: str
    unit: str
    attributes: Mapping[str, str]  # Prometheus label -> OTel attribute


OTEL: dict[str, OtelName] = {
    REQUEST_DURATION: OtelName("gen_ai.server.request.duration", "s", _ATTRIBUTES),
    TIME_TO_FIRST_TOKEN: OtelName("gen_ai.server.time_to_first_token", "s", _ATTRIBUTES),
    TIME_PER_OUTPUT_TOKEN: OtelName("gen_ai.server.time_per_output_token", "s", _ATTRIBUTES),
    TOKEN_USAGE: OtelName("gen_ai.client.token.usage", "{token}", _ATTRIBUTES),
}


def operation_name(kind: str) -> str:
    """``gen_ai.operation.name`` of a route kind (``chat`` | ``completion``)."""
    return "chat" if kind == "chat" else "text_completion"


class GenAiServer:
    """``gen_ai.server.*``: every request's duration, and for successful responses the time
    to the first token and per output token after it."""

    def __init__(self, registry: Registry) -> None:
        h = registry.histogram
        self.duration = h(REQUEST_DURATION, "GenAI server request duration: request received "
                          "to response ended, every request; error_type set when it failed.",
                          (*LABELS, "error_type"), DURATION_BUCKETS)
        self.ttft = h(TIME_TO_FIRST_TOKEN, "Time to generate the first token, successful "
                      "responses.", LABELS, TTFT_BUCKETS)
        self.tpot = h(TIME_PER_OUTPUT_TOKEN, "Time per output token generated after the "
                      "first, successful responses with at least two output tokens.", LABELS,
                      TPOT_BUCKETS)

    def ended(self, operation: str, model: str, duration_s: float, error_type: str) -> None:
        """A request ended; ``error_type`` is empty for a success."""
        self.duration.observe(duration_s, operation, PROVIDER, model, error_type)

    def answered(self, operation: str, model: str, ttft_s: float | None,
                 tpot_s: float | None) -> None:
        """A successful response's TTFT and TPOT (None: not measured, or < 2 tokens)."""
        if ttft_s is not None:
            self.ttft.observe(ttft_s, operation, PROVIDER, model)
        if tpot_s is not None:
            self.tpot.observe(tpot_s, operation, PROVIDER, model)


class GenAiClient:
    """``gen_ai.client.token.usage``: one observation per token type of a settled request."""

    def __init__(self, registry: Registry) -> None:
        self.token_usage = registry.histogram(
            TOKEN_USAGE, "Tokens used by a request to the upstream, by gen_ai_token_type "
            "(input, output).", (*LABELS, "gen_ai_token_type"), TOKEN_USAGE_BUCKETS)

    def used(self, operation: str, model: str, input_tokens: int, output_tokens: int) -> None:
        self.token_usage.observe(input_tokens, operation, PROVIDER, model, "input")
        self.token_usage.observe(output_tokens, operation, PROVIDER, model, "output")
