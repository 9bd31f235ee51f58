"""The isolation benchmark's parts that need no servers: its tenants, its attack bodies and
its verdicts (the run itself is `python -m loadtest.isolation`, not part of the suite)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from gateway.config import TenantsFile
from loadtest import isolation


def test_the_tenants_are_valid_and_the_attacker_is_capped() -> None:
    tenants = TenantsFile.model_validate(yaml.safe_load(isolation.tenants_yaml()))
    caps = {t.id: t.caps.max_prompt_tokens for t in tenants.tenants}
    assert caps == {"attacker": 8192, "victim": None}


def test_both_attack_shapes_fit_the_body_limit_and_overflow_the_cap() -> None:
    shapes = isolation.big_shapes()
    assert set(shapes) == {"one message", "many messages"}
    for body in shapes.values():
        assert 3_500_000 < len(body) < 4 * 1024 * 1024
        messages = json.loads(body)["messages"]
        assert messages and all(m["role"] == "user" for m in messages)
    assert len(json.loads(shapes["many messages"])["messages"]) == isolation.MANY_MESSAGES


def result(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "phases": {n: {"requests": 40, "errors": 0, "p50_ms": 10.0, "p99_ms": 20.0}
                   for n in ("baseline", "big bodies", "after", "slowloris")},
        "refusals": {"one message": {"count": 6, "statuses": [413], "max_ms": 80.0,
                                     "median_ms": 50.0}},
        "added_p99_ms": 12.0, "rss_mib": {"before": 80.0, "after": 81.0, "delta": 1.0},
        "slowloris_p50_ratio": 1.05, "slowloris_connections_opened": 200}
    base.update(over)
    return base


@pytest.mark.parametrize(("over", "failing"), [
    ({}, None),
    ({"added_p99_ms": 51.0}, 0),
    ({"refusals": {"many messages": {"count": 3, "statuses": [413], "max_ms": 250.0,
                                     "median_ms": 240.0}}}, 1),
    ({"refusals": {"one message": {"count": 3, "statuses": [500], "max_ms": 20.0,
                                   "median_ms": 20.0}}}, 1),  # fast, but not a refusal
    ({"rss_mib": {"before": 80.0, "after": 140.0, "delta": 60.0}}, 2),
    ({"slowloris_p50_ratio": 1.3}, 3),
])
def test_each_target_is_judged(over: dict[str, Any], failing: int | None,
                               capsys: pytest.CaptureFixture[str]) -> None:
    checks = isolation.report(result(**over))
    assert [ok for *_, ok in checks] == [i != failing for i in range(4)]
    assert ("MISS" in capsys.readouterr().out) is (failing is not None)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        isolation.main(["--rate", "0"])
    assert exc.value.code == 2
