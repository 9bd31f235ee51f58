"""`sluice loadtest compare RUN_A RUN_B`: is B better or worse than A, beyond the noise?

Everything is computed from each run's ``requests.jsonl`` (measured arrivals only) plus
``report.json`` (the window, headline figures) and ``details.json`` (workload, seed, mode).

The bootstrap. The unit of resampling is the measured arrival: a replicate draws n
arrivals with replacement, in A and in B independently, and recomputes every statistic
from the drawn arrivals. A scalar metric (TTFT, E2E, ...) is an arrival's list of 0 or 1
values; ITL and ICL are lists of many values that travel together (a cluster bootstrap:
the tokens of one answer are correlated, so resampling tokens would understate the
noise). Rates are shares of the drawn arrivals, so they are conditional on the number of
arrivals (both runs of an A/B normally replay the same seeded schedule). The interval is
the percentile interval of the replicates' B − A. The percentiles of each replicate come from loadtest/compare_bootstrap.py.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.compare_bootstrap import STATS, Floats, Pooled, point_stats, pooled, weighted_stats

__all__ = ["STATS", "CompareError", "Comparison", "Difference", "Group", "Pooled",
           "compare_main", "compare_runs", "difference", "point_stats", "pooled",
           "weighted_stats", "write_comparison"]

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "icl_ms", "e2e_ms", "queue_ms")
RATES = ("goodput_rps", "achieved_rps", "slo_attainment", "reject_share", "error_share")
HIGHER_IS_BETTER = frozenset({"goodput_rps", "achieved_rps", "slo_attainment"})
HEADLINE = ("offered_rps", "achieved_rps", "goodput_rps", "slo_attainment",
            "cost_per_success")
VERDICTS = ("better", "worse", "no significant change", "n/a")
ALL = "all"
_CELLS = 2_000_000  # resamples x arrivals per chunk: bounds memory whatever the run size


class CompareError(ValueError):
    """A run directory that is missing or cannot be read as a `sluice loadtest` run."""


@dataclass(slots=True, frozen=True)
class Run:
    """One `sluice loadtest` run directory, read."""

    path: Path
    report: dict[str, Any]
    details: dict[str, Any]
    rows: tuple[dict[str, Any], ...]  # measured arrivals, in file order

    @property
    def window_s(self) -> float:
        return float(self.report["duration_s"])


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CompareError(f"{path}: missing (not a `sluice loadtest --out` directory?)")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CompareError(f"{path}: unreadable: {exc}") from exc
    if not isinstance(data, dict):
        raise CompareError(f"{path}: not a JSON object")
    return data


def load_run(path: Path) -> Run:
    """Read report.json, details.json (optional) and the measured rows of requests.jsonl."""
    if not path.is_dir():
        raise CompareError(f"{path}: no such run directory")
    report = _read_json(path / "report.json", required=True)
    details = _read_json(path / "details.json", required=False)
    dur = report.get("duration_s")
    if not isinstance(dur, int | float) or dur <= 0:
        raise CompareError(f"{path / 'report.json'}: duration_s must be a positive number")
    jsonl = path / "requests.jsonl"
    if not jsonl.is_file():
        raise CompareError(f"{jsonl}: missing (not a `sluice loadtest --out` directory?)")
    rows = []
    for no, line in enumerate(jsonl.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CompareError(f"{jsonl}:{no}: bad JSON: {exc}") from exc
        if not isinstance(row, dict) or "outcome" not in row or "class" not in row:
            raise CompareError(f"{jsonl}:{no}: a row needs at least `class` and `outcome`")
        if row.get("measured", True):
            rows.append(row)
    if not rows:
        raise CompareError(f"{jsonl}: no measured arrivals")
    return Run(path, report, details, tuple(rows))


def _values(row: dict[str, Any], key: str, where: str) -> list[float]:
    v = row.get(key)
    items = v if isinstance(v, list) else [v]
    try:
        return [float(x) for x in items if x is not None]
    except (TypeError, ValueError) as exc:
        raise CompareError(f"{where}: `{key}` is not a number or a list of numbers") from exc


@dataclass(slots=True, frozen=True, eq=False)
class Group:
    """The arrivals of one class (or all of them) in one run, ready to resample."""

    n: int
    window_s: float
    shares: dict[str, Floats]  # per rate: each arrival's contribution (0/1)
    metrics: dict[str, Pooled]

    @staticmethod
    def of(rows: Sequence[dict[str, Any]], window_s: float, where: str) -> Group:
        outcome = [r["outcome"] for r in rows]

        def ind(names: tuple[str, ...]) -> Floats:
            return np.array([o in names for o in outcome], dtype=np.float64)

        shares = {"goodput_rps": ind(("success",)), "achieved_rps": ind(("success", "slo_miss")),
                  "slo_attainment": ind(("success",)),
                  "reject_share": ind(("rejected_429", "rejected_503")),
                  "error_share": ind(("error", "timeout"))}
        metrics = {k: pooled([_values(r, k, f"{where} idx {r.get('idx')}") for r in rows])
                   for k in LATENCIES}
        return Group(len(rows), window_s, shares, metrics)

    def rate(self, name: str, w: Floats) -> Floats:
        """The rate ``name`` for each replicate's counts ``w`` (w = ones: the run itself)."""
        hits = w @ self.shares[name]
        return hits / self.window_s if name.endswith("_rps") else hits / self.n

    def replicates(self, resamples: int, rng: np.random.Generator) -> dict[str, Floats]:
        """Per latency: STATS x resamples; per rate: resamples."""
        parts: dict[str, list[Floats]] = {k: [] for k in (*LATENCIES, *RATES)}
        chunk = max(1, _CELLS // self.n)
        for first in range(0, resamples, chunk):
            r = min(chunk, resamples - first)
            idx = rng.integers(0, self.n, size=(r, self.n))
            flat = (idx + (np.arange(r) * self.n)[:, None]).ravel()
            w = np.bincount(flat, minlength=r * self.n).reshape(r, self.n).astype(np.float64)
            for k, p in self.metrics.items():
                parts[k].append(weighted_stats(p, w))
            for k in RATES:
                parts[k].append(self.rate(k, w))
        return {k: np.concatenate(v, axis=-1) for k, v in parts.items()}


@dataclass(slots=True, frozen=True)
class Difference:
    """B − A for one statistic of one metric of one group, with its bootstrap interval."""

    group: str  # a class name, or "all"
    metric: str  # a latency (ms), a rate, or a headline key
    stat: str  # p50 | p90 | p99 | mean for latencies, "value" otherwise
    a: float | None
    b: float | None
    diff: float | None
    rel_pct: float | None  # diff / a, in %
    ci: tuple[float, float] | None  # percentile interval of B − A
    verdict: str  # one of VERDICTS
    higher_is_better: bool

    @property
    def rel_ci(self) -> tuple[float, float] | None:
        if self.ci is None or not self.a:
            return None
        return self.ci[0] / abs(self.a) * 100, self.ci[1] / abs(self.a) * 100


def difference(group: str, metric: str, stat: str, a: float | None, b: float | None,
               reps: tuple[Floats, Floats] | None, confidence: float) -> Difference:
    """B − A, its percentile interval from the paired replicates, and the verdict."""
    higher = metric in HIGHER_IS_BETTER
    if a is None or b is None:
        return Difference(group, metric, stat, a, b, None, None, None, "n/a", higher)
    diff = b - a
    rel = diff / abs(a) * 100 if a else None
    ci, verdict = None, "n/a"
    if reps is not None:
        d = reps[1] - reps[0]
        d = d[np.isfinite(d)]
        if len(d) * 2 >= len(reps[0]):  # an interval from under half the replicates lies
            tail = (1 - confidence) / 2 * 100
            lo, hi = (float(x) for x in np.percentile(d, [tail, 100 - tail]))
            ci = (lo, hi)
            verdict = "no significant change"
            if lo > 0 or hi < 0:
                verdict = "better" if (lo > 0) == higher else "worse"
    return Difference(group, metric, stat, a, b, diff, rel, ci, verdict, higher)


@dataclass(slots=True, frozen=True)
class RunInfo:
    path: str
    workload: str | None
    seed: int | None
    mode: dict[str, Any] | None
    measured: int
    window_s: float
    unreliable: bool
    partial: bool
    notes: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class Comparison:
    """Everything `compare` found; ``to_dict`` is compare.json."""

    a: RunInfo
    b: RunInfo
    confidence: float
    resamples: int
    seed: int
    headline: tuple[Difference, ...]
    differences: tuple[Difference, ...]  # per group (all first), latencies then rates
    warnings: tuple[str, ...]
    # "all" group, per latency with data: (A, B) values at 201 evenly spaced quantiles
    cdfs: dict[str, tuple[tuple[float, ...], tuple[float, ...]]]

    @property
    def tested(self) -> int:
        """Differences with an interval: each is a chance to be fooled."""
        return sum(d.ci is not None for d in self.differences)

    @property
    def expected_by_chance(self) -> float:
        """Differences expected outside their interval if nothing had changed (an upper
        figure of sorts: the differences are correlated, not independent)."""
        return self.tested * (1 - self.confidence)

    def verdict_counts(self) -> dict[str, int]:
        return {v: sum(d.verdict == v for d in self.differences) for v in VERDICTS}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("cdfs")
        d.update(tested=self.tested, expected_by_chance=round(self.expected_by_chance, 2),
                 verdict_counts=self.verdict_counts())
        return d


def _info(run: Run) -> RunInfo:
    r, d = run.report, run.details
    return RunInfo(str(run.path), d.get("workload"), d.get("seed"), d.get("mode"),
                   len(run.rows), run.window_s, bool(r.get("unreliable")),
                   bool(r.get("partial")), tuple(str(n) for n in r.get("notes") or ()))


FEW_REQUESTS = 50  # fewer measured requests than this: the percentile intervals are too narrow


def comparability(a: Run, b: Run) -> list[str]:
    """Why A and B might not be a fair A/B (empty when nothing is known to differ)."""
    out = []
    for side, run in (("A", a), ("B", b)):
        if not run.details:
            out.append(f"run {side} has no details.json: workload, seed and mode unchecked")
        if run.report.get("unreliable"):
            out.append(f"run {side} is flagged unreliable: "
                       + "; ".join(str(n) for n in run.report.get("notes") or ()))
        if run.report.get("partial"):
            out.append(f"run {side} is partial (interrupted before the end of its window)")
    if a.details and b.details:
        for key in ("workload", "seed", "mode"):
            va, vb = a.details.get(key), b.details.get(key)
            if va != vb:
                out.append(f"different {key}: A {va!r}, B {vb!r}")
    oa, ob = a.report.get("offered_rps"), b.report.get("offered_rps")
    if isinstance(oa, int | float) and isinstance(ob, int | float) and oa > 0 \
            and abs(ob - oa) > 0.05 * oa:
        out.append(f"offered rates more than 5% apart: A {oa:.4g} rps, B {ob:.4g} rps")
    for side, run in (("A", a), ("B", b)):
        n = sum(1 for r in run.rows if r.get("measured"))
        if n < FEW_REQUESTS:
            out.append(f"run {side} measured only {n} requests: a bootstrap interval of a "
                       f"percentile (p90, p99 above all) is too narrow on so few; take the "
                       f"verdicts as hints")
    ca = {r["class"] for r in a.rows}
    cb = {r["class"] for r in b.rows}
    for name in sorted(ca ^ cb):
        out.append(f"class {name!r} only in run {'A' if name in ca else 'B'}")
    return out


def _rng(seed: int, side: int, group: str) -> np.random.Generator:
    # keyed by the group's name, so adding a class leaves the other classes' draws alone
    return np.random.default_rng([seed, side, zlib.crc32(group.encode())])


def _compare_group(name: str, ga: Group | None, gb: Group | None, confidence: float,
                   resamples: int, seed: int) -> tuple[list[Difference], dict[str, Any]]:
    ra = ga.replicates(resamples, _rng(seed, 0, name)) if ga else None
    rb = gb.replicates(resamples, _rng(seed, 1, name)) if gb else None
    out: list[Difference] = []
    for k in LATENCIES:
        pa = point_stats(ga.metrics[k].values) if ga else [None] * len(STATS)
        pb = point_stats(gb.metrics[k].values) if gb else [None] * len(STATS)
        if all(v is None for v in (*pa, *pb)):
            continue  # no data on either side
        for i, stat in enumerate(STATS):
            reps = (ra[k][i], rb[k][i]) if ra and rb else None
            out.append(difference(name, k, stat, pa[i], pb[i], reps, confidence))
    for k in RATES:
        va = float(ga.rate(k, np.ones((1, ga.n)))[0]) if ga else None
        vb = float(gb.rate(k, np.ones((1, gb.n)))[0]) if gb else None
        reps = (ra[k], rb[k]) if ra and rb else None
        out.append(difference(name, k, "value", va, vb, reps, confidence))
    return out, {"a": ra, "b": rb}


def _cdf(p: Pooled) -> tuple[float, ...]:
    if not len(p.values):
        return ()
    return tuple(float(x) for x in np.quantile(p.values, np.linspace(0, 1, 201)))


def compare_runs(run_a: Path, run_b: Path, *, confidence: float = 0.95,
                 resamples: int = 2000, seed: int = 0) -> Comparison:
    """Compare two run directories: every statistic's B − A with a bootstrap interval."""
    if not 0 < confidence < 1:
        raise CompareError(f"confidence must be between 0 and 1, got {confidence}")
    if resamples < 100:
        raise CompareError(f"resamples must be at least 100, got {resamples}")
    a, b = load_run(Path(run_a)), load_run(Path(run_b))
    names = [ALL, *sorted({r["class"] for r in (*a.rows, *b.rows)}, key=str)]
    groups: dict[str, tuple[Group | None, Group | None]] = {}
    for name in names:
        pair = []
        for side, run in (("A", a), ("B", b)):
            rows = [r for r in run.rows if name == ALL or r["class"] == name]
            pair.append(Group.of(rows, run.window_s, f"{run.path} ({side})") if rows else None)
        groups[name] = (pair[0], pair[1])
    diffs: list[Difference] = []
    all_reps: dict[str, Any] = {}
    for name, (ga, gb) in groups.items():
        found, reps = _compare_group(name, ga, gb, confidence, resamples, seed)
        diffs += found
        if name == ALL:
            all_reps = reps
    headline = []
    for k in HEADLINE:
        va, vb = a.report.get(k), b.report.get(k)
        fa = float(va) if isinstance(va, int | float) else None
        fb = float(vb) if isinstance(vb, int | float) else None
        both = (all_reps["a"][k], all_reps["b"][k]) if k in RATES else None
        headline.append(difference(ALL, k, "value", fa, fb, both, confidence))
    ga_all, gb_all = groups[ALL]
    if ga_all is None or gb_all is None:  # load_run refuses a run without measured rows
        raise CompareError("a run has no measured arrivals")
    cdfs = {k: (_cdf(ga_all.metrics[k]), _cdf(gb_all.metrics[k])) for k in LATENCIES
            if len(ga_all.metrics[k].values) or len(gb_all.metrics[k].values)}
    return Comparison(_info(a), _info(b), confidence, resamples, seed, tuple(headline),
                      tuple(diffs), tuple(comparability(a, b)), cdfs)


def write_comparison(out: Path, cmp: Comparison) -> list[Path]:
    """compare.json, compare.md, compare.html (plots inlined) and the PNGs, in ``out``."""
    from loadtest.compare_report import write_all

    return write_all(Path(out), cmp)


def compare_main(run_a: str, run_b: str, out: str, confidence: float, resamples: int,
                 seed: int) -> int:
    """The command: 0 when compared (the verdict is in the output), 2 for a bad run dir."""
    from loadtest.compare_report import verdict_lines

    try:
        cmp = compare_runs(Path(run_a), Path(run_b), confidence=confidence,
                           resamples=resamples, seed=seed)
    except CompareError as exc:
        print(f"sluice loadtest compare: {exc}", file=sys.stderr)
        return 2
    written = write_comparison(Path(out), cmp)
    print("\n".join(verdict_lines(cmp)))
    print(f"report: {next(p for p in written if p.name == 'compare.html')}")
    return 0
