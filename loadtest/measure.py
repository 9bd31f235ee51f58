"""Side-by-side latency measurements: targets take turns in short segments of open-loop load.

Interleaving (A B B A A B …, each segment one target alone at the same rate) puts any drift
of the machine (frequency, noisy neighbours, caches) on every target alike, so differences
of percentiles between targets measured in one run are differences the targets made.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from loadtest.load_client import NOT_SENT, Pool, Sample, check_stream, open_loop

CHAT_BODY = (b'{"model":"fake","messages":[{"role":"user","content":"Say twenty words."}],'
             b'"stream":true,"max_tokens":20,"stream_options":{"include_usage":true}}')
MAX_ADDED_P99_S = 0.050  # a target sustains a rate while its p99 stays within this of direct
MAX_ERROR_SHARE = 0.01
MAX_LAG_P99_S = 0.005  # beyond this the client, not the server, shaped the load


def chat_request(port: int, key: str | None) -> bytes:
    auth = b"authorization: Bearer %s\r\n" % key.encode() if key else b""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n%s"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (port, auth, len(CHAT_BODY), CHAT_BODY))


@dataclass(slots=True)
class Target:
    """One way to reach the fake upstream: directly, or through a gateway."""

    name: str
    pool: Pool
    cpu_seconds: Callable[[], float] | None = None  # CPU of the gateway's processes
    # the gateway's pause counters now (``scrape_pauses``): read around each segment
    pauses: Callable[[], dict[str, float]] | None = None


# What ``telemetry/pauses.py`` and the renewal beat count, summed over their labels: read
# before and after a segment, they say what a bad segment had in it.
PAUSE_COUNTERS = ("gc_long_pauses_total", "gc_pause_seconds_total", "loop_stalls_total",
                  "loop_stall_seconds_total", "renew_beats_total", "renew_beat_seconds_total")


def scrape_pauses(port: int, prefix: str = "sluice_gateway_") -> dict[str, float]:
    """The pause counters of a gateway's ``/metrics`` (absent ones: 0)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = dict.fromkeys(PAUSE_COUNTERS, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{", 1)[0].removeprefix(prefix)
        if name in out:
            out[name] += float(value.split()[0])
    return out


# Past this share of the machine's CPU time taken by the hypervisor (``steal`` in
# /proc/stat) in a run, its latencies say more about the neighbours than about the gateway.
MAX_STEAL = 0.02


def host_cpu() -> tuple[int, int] | None:
    """(steal, all) CPU time of this machine since boot, in jiffies, from /proc/stat's
    ``cpu`` line: what a virtual machine's host ran elsewhere while this one wanted to run,
    and everything; None where there is no /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    ticks = [int(v) for v in fields[1:9]]
    return ticks[7], sum(ticks)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    """The share of the machine's CPU time stolen between two ``host_cpu()`` readings
    (NaN when unknown)."""
    if before is None or after is None or after[1] <= before[1]:
        return math.nan
    return (after[0] - before[0]) / (after[1] - before[1])


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN for no values."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(slots=True)
class Stats:
    """Latency summary of one target's samples, in milliseconds."""

    n: int
    errors: int
    error_kinds: dict[str, int]
    e2e_p50_ms: float
    e2e_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    lag_p99_ms: float
    cpu_us_per_request: float | None = None
    # e2e p99 of each of its segments, in order (interleaved runs): one bad segment (a
    # neighbour's burst, a pause) shows here as one outlier
    segment_p99_ms: list[float] = field(default_factory=list)
    # per segment, what the gateway counted in it (PAUSE_COUNTERS' increments), if read
    segment_pauses: list[dict[str, float]] = field(default_factory=list)
    # per segment, the share of the machine's CPU time its hypervisor took (NaN: unknown)
    segment_steal: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, samples: list[Sample], chunks: int, cpu_s: float | None) -> Stats:
        verdicts = [check_stream(s, chunks) for s in samples]
        good = [s for s, v in zip(samples, verdicts, strict=True) if not v]
        e2e = sorted(s.e2e for s in good)
        ttft = sorted(s.ttft for s in good if s.first)
        lag = sorted(s.lag for s in samples)
        kinds = Counter(v for v in verdicts if v)
        ms = 1000.0
        return cls(n=len(samples), errors=sum(kinds.values()), error_kinds=dict(kinds),
                   e2e_p50_ms=percentile(e2e, 50) * ms, e2e_p99_ms=percentile(e2e, 99) * ms,
                   ttft_p50_ms=percentile(ttft, 50) * ms, ttft_p99_ms=percentile(ttft, 99) * ms,
                   lag_p99_ms=percentile(lag, 99) * ms,
                   cpu_us_per_request=None if cpu_s is None or not samples
                   else cpu_s / len(samples) * 1e6)

    @property
    def error_share(self) -> float:
        return self.errors / self.n if self.n else 1.0

    @property
    def client_lagged(self) -> bool:
        return self.lag_p99_ms > MAX_LAG_P99_S * 1000

    @property
    def steal(self) -> float:
        """The mean of its segments' stolen shares (segments are of equal length)."""
        known = [v for v in self.segment_steal if math.isfinite(v)]
        return sum(known) / len(known) if known else math.nan


async def warm_up(targets: Sequence[Target], rate: float = 25.0, seconds: float = 2.0) -> None:
    """Load each target gently once, so lazy imports and first connections are not timed."""
    for target in targets:
        await target.pool.warm(8)
        await open_loop(target.pool, rate, seconds, max_in_flight=64)


async def interleaved(targets: Sequence[Target], rate: float, seconds: float,
                      segment_s: float, chunks: int, overload_s: float = 2.0,
                      give_up: bool = False, warmup_s: float = 0.25) -> dict[str, Stats]:
    """Each target gets `seconds` of load at `rate`, in alternating segments; its Stats.

    A target with more than `overload_s` seconds' worth of requests in flight is taken
    as overloaded for the rest of its segment (see `open_loop`), and with `give_up` for
    the rest of the run: its unsent requests count as errors either way.
    """
    cap = math.ceil(rate * overload_s) + 20
    for target in targets:
        await target.pool.warm(math.ceil(rate * 0.02) + 4)
        await open_loop(target.pool, rate, warmup_s, cap)  # discarded
    samples: dict[str, list[Sample]] = {t.name: [] for t in targets}
    cpu: dict[str, float] = {t.name: 0.0 for t in targets}
    segments: dict[str, list[float]] = {t.name: [] for t in targets}
    pauses: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets}
    steal: dict[str, list[float]] = {t.name: [] for t in targets}
    overloaded: set[str] = set()
    for k in range(max(1, round(seconds / segment_s))):
        for target in (targets if k % 2 == 0 else list(reversed(targets))):
            if target.name in overloaded:
                continue
            before = target.cpu_seconds() if target.cpu_seconds else 0.0
            paused = target.pauses() if target.pauses else None
            host0 = host_cpu()
            got = await open_loop(target.pool, rate, segment_s, cap)
            steal[target.name].append(steal_share(host0, host_cpu()))
            if target.pauses and paused is not None:
                now = target.pauses()
                pauses[target.name].append({k: round(now[k] - paused[k], 6) for k in now})
            if target.cpu_seconds:
                cpu[target.name] += target.cpu_seconds() - before
            samples[target.name] += got
            e2e = sorted(s.e2e for s in got if s.status == 200 and not s.error)
            segments[target.name].append(round(percentile(e2e, 99) * 1000, 3))
            if give_up and any(s.error == NOT_SENT for s in got):
                overloaded.add(target.name)
    out = {t.name: Stats.of(samples[t.name], chunks, cpu[t.name] if t.cpu_seconds else None)
           for t in targets}
    for name, stats in out.items():
        stats.segment_p99_ms = segments[name]
        stats.segment_pauses = pauses[name]
        stats.segment_steal = steal[name]
    return out


@dataclass(slots=True)
class Step:
    rate: float
    direct: Stats
    target: Stats
    sustained: bool = False

    @property
    def added_p99_ms(self) -> float:
        return self.target.e2e_p99_ms - self.direct.e2e_p99_ms

    @property
    def reliable(self) -> bool:
        return not (self.direct.client_lagged or self.target.client_lagged)


@dataclass(slots=True)
class Sweep:
    """The highest rate a target sustained, under `criterion`; `limit` says what stopped it.

    criterion "absolute": p99 added <= 50 ms over direct at the same rate, errors < 1 %.
    criterion "relative", for a target that adds more than 50 ms even at `PROBE_RATE`:
    p99 added <= its added p99 at `PROBE_RATE` + 50 ms (load may add 50 ms of queueing).
    """

    target: str
    criterion: str = "absolute"
    probe_added_p99_ms: float = 0.0
    max_rate: float = 0.0
    limit: str = ""
    steps: list[Step] = field(default_factory=list)

    @property
    def allowed_added_p99_ms(self) -> float:
        extra = self.probe_added_p99_ms if self.criterion == "relative" else 0.0
        return extra + MAX_ADDED_P99_S * 1000


LADDER = (100, 200, 300, 400, 600, 800, 1000, 1300, 1600, 2000, 2500, 3000, 4000, 5000)
PROBE_RATE = 10.0
LOWEST_RATE = 5.0


async def sweep(direct: Target, target: Target, step_s: float, segment_s: float,
                min_requests: int, chunks: int, refinements: int,
                log: Callable[[str], None],
                on_step: Callable[[Step], str] | None = None) -> Sweep:
    """Find the highest sustained rate: a light-load probe (which picks the criterion), then
    up the ladder from 100/s while the target keeps up, or down by halves while it does
    not, then bisect between the last pass and the first fail.

    Each step loads both sides for `step_s` seconds, or long enough for `min_requests`.
    A target is given up for the step (failed, as overloaded) past 0.5 s worth of requests
    in flight: 10x the 50 ms it may add. `on_step`, after each step, returns a note for the
    step's log line.
    """
    result = Sweep(target.name)

    async def measure(rate: float, requests: int = min_requests) -> Step:
        seconds = max(step_s, requests / rate)
        stats = await interleaved([direct, target], rate, seconds,
                                  max(segment_s, seconds / 3), chunks, overload_s=0.5,
                                  give_up=True)
        step = Step(rate, stats[direct.name], stats[target.name])
        step.sustained = (step.target.error_share < MAX_ERROR_SHARE
                          and step.added_p99_ms <= result.allowed_added_p99_ms)
        result.steps.append(step)
        note = on_step(step) if on_step else ""
        log(f"  {target.name} @ {rate:5.4g}/s: p99 {step.target.e2e_p99_ms:8.2f} ms "
            f"(direct {step.direct.e2e_p99_ms:7.2f}), errors {step.target.error_share:6.1%}, "
            f"client lag p99 {max(step.direct.lag_p99_ms, step.target.lag_p99_ms):5.1f} ms"
            f"{'' if step.sustained else '  <- not sustained'}"
            f"{'' if step.reliable else '  (client lagged: unreliable)'}{note}")
        return step

    async def run(rate: float) -> bool:
        step = await measure(rate)
        if step.direct.error_share >= MAX_ERROR_SHARE:
            result.limit = "the direct path failed too (fake upstream or client saturated)"
            return False
        if step.sustained:
            result.max_rate = max(result.max_rate, rate)
        else:
            result.limit = (f"p99 added > {result.allowed_added_p99_ms:.0f} ms or errors >= 1%"
                            + ("" if step.reliable else "; the client lagged at this step"))
        return step.sustained

    probe = await measure(PROBE_RATE, max(20, min_requests // 2))
    result.probe_added_p99_ms = max(0.0, probe.added_p99_ms)
    if not probe.sustained and probe.target.error_share < MAX_ERROR_SHARE:
        result.criterion = "relative"
        log(f"  {target.name} adds {probe.added_p99_ms:.1f} ms at p99 even at "
            f"{PROBE_RATE:g}/s: it never meets 50 ms; searching for the rate where load "
            f"adds 50 ms more")
    low: float | None = None
    high: float | None = None
    if await run(LADDER[0]):
        low = LADDER[0]
        for rate in LADDER[1:]:
            if not await run(rate):
                high = rate
                break
            low = rate
        else:
            result.limit = f"the ladder ends at {LADDER[-1]}/s"
    else:
        high = LADDER[0]
        while high / 2 >= LOWEST_RATE:
            if await run(high / 2):
                low = high / 2
                break
            high /= 2
        else:
            result.limit += f"; not sustained even at {high:g}/s"
    for _ in range(refinements):
        if low is None or high is None or high - low <= max(5.0, 0.05 * low):
            break
        mid = round((low + high) / 2)
        if await run(mid):
            low = mid
        else:
            high = mid
    return result
