"""The workload spec of `sluice loadtest`: a YAML file validated with pydantic.

The schema is a contract (the resilience and planning tools read workloads too): keep the
field names. Every error names the bad field (``classes.0.lengths.buckets``), so a typo
fails at load time with exit status 2, never halfway through a run.

Input and output lengths are *joint*: a bucket or a pair fixes both together, because real
traffic correlates them (long documents get short summaries, chats get short questions
and long answers); two independent distributions would invent requests nobody sends.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loadtest.dataset import DatasetSpec


class WorkloadError(ValueError):
    """The workload file is missing, unreadable or invalid; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Piece(_Strict):
    until_s: float = Field(gt=0)
    rate: float = Field(ge=0)


class TraceRow(BaseModel):
    """One line of a replay trace: an arrival at ``t`` seconds from the start."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    t: float = Field(ge=0)
    input: int = Field(ge=1)
    output: int = Field(ge=1)
    class_: str | None = Field(None, alias="class")
    tenant: str | None = None
    priority: int | None = None


class Arrival(_Strict):
    process: Literal["constant", "poisson", "gamma", "piecewise", "diurnal", "replay"]
    rate: float | None = Field(None, gt=0)
    shape: float | None = Field(None, gt=0)
    pieces: list[Piece] | None = None
    period_s: float | None = Field(None, gt=0)
    amplitude: float | None = Field(None, ge=0, le=1)
    trace: str | None = None
    # Filled by load_workload for replay (the trace's rows), never written by users.
    rows: tuple[TraceRow, ...] = ()

    @model_validator(mode="after")
    def _needs(self) -> Arrival:
        need = {"constant": ("rate",), "poisson": ("rate",), "gamma": ("rate", "shape"),
                "piecewise": ("pieces",), "diurnal": ("rate", "period_s", "amplitude"),
                "replay": ("trace",)}[self.process]
        for name in need:
            if getattr(self, name) is None:
                raise ValueError(f"arrival.{name} is required for process {self.process!r}")
        if self.pieces is not None:
            ends = [p.until_s for p in self.pieces]
            if not ends or ends != sorted(ends) or len(set(ends)) != len(ends):
                raise ValueError("arrival.pieces: until_s must increase strictly")
        return self


class Patience(_Strict):
    dist: Literal["fixed", "lognormal", "exponential"] = "lognormal"
    median: float = Field(gt=0)  # ms
    sigma: float = Field(0.5, ge=0)  # lognormal only


class Cancel(_Strict):
    share: float = Field(ge=0, le=1)
    patience_ms: Patience | None = None  # abandon if no first token by then
    after_tokens: int | None = Field(None, ge=1)  # abandon after this many tokens

    @model_validator(mode="after")
    def _some_trigger(self) -> Cancel:
        if self.share > 0 and self.patience_ms is None and self.after_tokens is None:
            raise ValueError("cancel needs patience_ms or after_tokens")
        return self


class Slo(_Strict):
    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    e2e_ms: float | None = Field(None, gt=0)


class Bucket(_Strict):
    input: int = Field(ge=1)
    output: int = Field(ge=1)
    weight: float = Field(1.0, gt=0)


class Lengths(_Strict):
    buckets: list[Bucket] | None = None
    pairs: list[tuple[int, int]] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> Lengths:
        if (self.buckets is None) == (self.pairs is None):
            raise ValueError("lengths needs exactly one of buckets or pairs")
        if not (self.buckets or self.pairs):
            raise ValueError("lengths is empty")
        if self.pairs and any(i < 1 or o < 1 for i, o in self.pairs):
            raise ValueError("lengths.pairs: lengths must be >= 1")
        return self


class ClassSpec(_Strict):
    name: str = Field(min_length=1)
    share: float = Field(gt=0)
    key: str | None = None
    key_env: str | None = None
    tenant: str | None = None
    priority: int | None = None
    deadline_ms: float | None = Field(None, gt=0)
    max_tokens_slack: int = Field(0, ge=0)
    slo: Slo = Slo()
    lengths: Lengths
    prefix_group: str | None = None
    cancel: Cancel | None = None
    model: str | None = None

    def length_pairs(self) -> list[tuple[int, int, float]]:
        """(input, output, weight) rows; empirical pairs weigh 1 each."""
        if self.lengths.buckets is not None:
            return [(b.input, b.output, b.weight) for b in self.lengths.buckets]
        return [(i, o, 1.0) for i, o in self.lengths.pairs or []]

    def api_key(self, default: str | None) -> str | None:
        """The tenant key: ``key``, else ``$key_env``, else the CLI's ``--key``."""
        if self.key:
            return self.key
        if self.key_env:
            return os.environ.get(self.key_env) or default
        return default

    @property
    def label(self) -> str:
        return self.tenant or self.name


class PrefixGroup(_Strict):
    name: str = Field(min_length=1)
    tokens: int = Field(ge=1)
    # distinct prefixes in the group (documents, system prompts of many apps); each request
    # of the group starts with one of them, drawn uniformly from its index and the seed
    count: int = Field(1, ge=1, le=100_000)


class Cost(_Strict):
    machine_hour_usd: float | None = Field(None, ge=0)
    input_per_mtok_usd: float | None = Field(None, ge=0)
    output_per_mtok_usd: float | None = Field(None, ge=0)


class Workload(_Strict):
    name: str = "workload"
    seed: int = 0
    # Open loop: arrivals follow `arrival` whatever the target does. Closed loop
    # (`concurrency`): that many requests in flight, each sent when the one before it in its
    # slot ended (plus `think_time_ms`). Exactly one of the two.
    duration_s: float = Field(gt=0)
    warmup_s: float = Field(0.0, ge=0)
    cooldown_s: float = Field(0.0, ge=0)
    model: str = "sluice-tiny"
    api: Literal["chat", "completions"] = "chat"
    # Ask the server to generate exactly the drawn output length (vLLM and the bundled
    # backend honour it); set false for servers that refuse the field (OpenAI itself).
    ignore_eos: bool = True
    arrival: Arrival | None = None
    concurrency: int | None = Field(None, ge=1, le=10_000)
    think_time_ms: float = Field(0.0, ge=0)  # closed loop: pause between a slot's requests
    requests: int | None = Field(None, ge=1)  # stop after this many (and at duration_s)
    dataset: DatasetSpec | None = None  # real prompts instead of synthetic words
    classes: list[ClassSpec] = Field(min_length=1)
    prefix_groups: list[PrefixGroup] = []
    cost: Cost | None = None
    slo_attainment_goal: float = Field(0.9, gt=0, le=1)

    @model_validator(mode="after")
    def _consistent(self) -> Workload:
        if (self.arrival is None) == (self.concurrency is None):
            raise ValueError("give exactly one of arrival (open loop) or concurrency "
                             "(closed loop)")
        if self.think_time_ms and self.concurrency is None:
            raise ValueError("think_time_ms applies to closed loop (concurrency) only")
        if self.warmup_s + self.cooldown_s >= self.duration_s:
            raise ValueError("warmup_s + cooldown_s must be shorter than duration_s")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError("classes: names must be unique")
        groups = {g.name for g in self.prefix_groups}
        for i, c in enumerate(self.classes):
            if c.prefix_group is not None and c.prefix_group not in groups:
                raise ValueError(f"classes.{i}.prefix_group: no prefix group "
                                 f"{c.prefix_group!r}")
        return self

    def mean_rate(self) -> float:
        """Mean offered requests/s over ``duration_s``, whatever the arrival process (0 in
        closed loop: the target's pace sets the rate)."""
        a = self.arrival
        if a is None:
            return 0.0
        if a.process == "piecewise":
            total, start = 0.0, 0.0
            for p in a.pieces or []:
                end = min(p.until_s, self.duration_s)
                if end > start:
                    total += p.rate * (end - start)
                start = max(start, p.until_s)
            if start < self.duration_s and a.pieces:  # the last rate holds to the end
                total += a.pieces[-1].rate * (self.duration_s - start)
            return total / self.duration_s
        if a.process == "replay":
            return sum(1 for r in a.rows if r.t < self.duration_s) / self.duration_s
        return float(a.rate or 0.0)

    def mode(self) -> dict[str, object]:
        """How the load is driven, for the report (details.json ``mode``)."""
        if self.concurrency is not None:
            return {"kind": "closed", "concurrency": self.concurrency,
                    "think_time_ms": self.think_time_ms or None}
        assert self.arrival is not None
        return {"kind": "open", "rate": round(self.mean_rate(), 6),
                "process": self.arrival.process}

    def class_named(self, name: str) -> ClassSpec:
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(name)

    def prefix_tokens(self, group: str | None) -> int:
        return next((g.tokens for g in self.prefix_groups if g.name == group), 0)

    def window(self) -> tuple[float, float]:
        """The measured window [start, end) of scheduled arrival times."""
        return self.warmup_s, self.duration_s - self.cooldown_s

    def scaled(self, factor: float) -> Workload:
        """The same workload at ``factor`` times the offered rate (for the sweep)."""
        a = self.arrival
        if a is None:
            raise ValueError("a closed-loop workload has no rate to scale")
        update: dict[str, object] = {}
        if a.rate is not None:
            update["rate"] = a.rate * factor
        if a.pieces is not None:
            update["pieces"] = [Piece(until_s=p.until_s, rate=p.rate * factor)
                                for p in a.pieces]
        if a.rows:
            update["rows"] = tuple(r.model_copy(update={"t": r.t / factor}) for r in a.rows)
        return self.model_copy(update={"arrival": a.model_copy(update=update)})


def _read_trace(path: Path) -> tuple[TraceRow, ...]:
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"arrival.trace: cannot read {path}: {exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(TraceRow.model_validate(json.loads(line)))
        except (ValueError, ValidationError) as exc:
            raise WorkloadError(f"arrival.trace: {path}:{n}: {exc}") from exc
    return tuple(sorted(rows, key=lambda r: r.t))


def _describe(exc: ValidationError) -> str:
    out = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "workload"
        out.append(f"{where}: {err['msg']}")
    return "; ".join(out)


def parse_workload(data: object, base: Path = Path(".")) -> Workload:
    """Validate an already-parsed YAML document; relative trace paths resolve from ``base``."""
    try:
        w = Workload.model_validate(data)
    except ValidationError as exc:
        raise WorkloadError(_describe(exc)) from exc
    if w.arrival is not None and w.arrival.process == "replay" and w.arrival.trace:
        trace = Path(w.arrival.trace)
        if not trace.is_absolute():
            trace = base / trace
        rows = _read_trace(trace)
        if not rows:
            raise WorkloadError(f"arrival.trace: {trace} has no arrivals")
        names = {c.name for c in w.classes}
        for row in rows:
            if row.class_ is not None and row.class_ not in names:
                raise WorkloadError(f"arrival.trace: unknown class {row.class_!r}")
        w = w.model_copy(update={"arrival": w.arrival.model_copy(update={"rows": rows})})
    if w.arrival is None:
        return w
    mean = w.mean_rate()
    if not math.isfinite(mean) or mean <= 0:
        raise WorkloadError("arrival: the mean rate must be positive")
    if w.arrival.process in ("piecewise", "replay"):
        # arrival.rate is the mean offered rate for every process (readers rely on it).
        w = w.model_copy(update={"arrival": w.arrival.model_copy(update={"rate": mean})})
    return w


def read_workload_data(path: str | Path) -> object:
    """The workload file's YAML document, unvalidated (the CLI's overrides go on it)."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise WorkloadError(f"cannot read {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{path} is not valid YAML: {exc}") from exc


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload YAML file (WorkloadError names the bad field)."""
    return parse_workload(read_workload_data(path), Path(path).parent)
