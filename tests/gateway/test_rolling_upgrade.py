"""A rolling upgrade of one member of a pool of two, under traffic: pins go only to members
serving their revision, and every answer is stamped with the versions of the member that
made it (each fake upstream records the request ids it answered and its revision then)."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Self

import httpx
import pytest

from gateway.config import GatewayConfig, Listen, ModelEntry, ResilienceConfig, RetryConfig
from protocol.versions import ResolvedVersions, ServedVersions, parse_header
from tests.backend.server.conftest import free_port

from .conftest import ThreadedGateway, auth, tenants_for_tests
from .fake_backend import FakeBackend

OLD, NEW, GONE = "a" * 64, "d" * 64, "e" * 64
REFRESH_S = 0.2
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}
GIVE_UP_S = 60.0


def pool_config(urls: list[str]) -> GatewayConfig:
    return GatewayConfig(
        listen=Listen(port=free_port()), refresh_interval_s=REFRESH_S,
        models=[ModelEntry(name="m", upstreams=urls, kind="sluice",  # type: ignore[arg-type]
                           tokenizer="upstream", upstream_model="fake-model")],
        resilience=ResilienceConfig(retry=RetryConfig(budget_ratio=1.0, budget_min_per_s=100,
                                                      backoff_base_s=0.001)))


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GIVE_UP_S
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


@dataclass(frozen=True)
class Answer:
    rid: str
    pin: str | None
    status: int
    headers: dict[str, str]
    fingerprints: frozenset[str]  # system_fingerprint of the body, or of every chunk
    models: frozenset[str]
    code: str | None

    @property
    def stamp(self) -> dict[str, str]:
        return parse_header(self.headers["x-sluice-resolved"])


def ask(client: httpx.Client, url: str, pin: str | None, stream: bool) -> Answer:
    rid = uuid.uuid4().hex
    body = {**CHAT, "model": "m" if pin is None else f"m@{pin}", "stream": stream}
    resp = client.post(url + "/v1/chat/completions", json=body,
                       headers={**auth(), "x-request-id": rid})
    objs: list[dict[str, Any]] = []
    code = None
    if resp.status_code != 200:
        code = resp.json()["error"]["code"]
    elif stream:
        objs = [json.loads(line[6:]) for line in resp.text.splitlines()
                if line.startswith("data: {")]
    else:
        objs = [resp.json()]
    return Answer(rid, pin, resp.status_code, dict(resp.headers),
                  frozenset(o["system_fingerprint"] for o in objs),
                  frozenset(o["model"] for o in objs), code)


class Traffic:
    """Client threads sending pinned (old, new, a revision never served) and unpinned
    requests, streamed and not, until stopped."""

    KINDS = ((None, False), (OLD[:8], True), (NEW[:10], False), (None, True),
             (OLD, False), (NEW[:8], True), (GONE[:9], False))

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url = url
        self.answers: list[Answer] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _run(self, offset: int) -> None:
        kinds = itertools.islice(itertools.cycle(self.KINDS), offset, None)
        with httpx.Client(timeout=30) as client:
            for pin, stream in kinds:
                if self.stop.is_set():
                    return
                self.answers.append(ask(client, self.url, pin, stream))

    def ok(self, pin_of: str | None, since: int = 0) -> int:
        return sum(1 for a in self.answers[since:] if a.status == 200 and a.pin is not None
                   and pin_of is not None and pin_of.startswith(a.pin))


def last_server(fakes: tuple[FakeBackend, ...]) -> dict[str, str]:
    """Request id → the revision of the member that answered it last (a request whose
    member moved under it is answered again by another)."""
    served: dict[str, tuple[float, str]] = {}
    for fake in fakes:
        for rid, revision, at in fake.served:
            if rid not in served or served[rid][0] < at:
                served[rid] = (at, revision)
    return {rid: revision for rid, (_, revision) in served.items()}


def fingerprint(revision: str, policy: str) -> str:
    """The fingerprint of an answer made at ``revision`` (the fakes' other versions)."""
    served = ServedVersions(revision, "b" * 64, "c" * 64, "fake-engine/1")
    return ResolvedVersions("m", served, policy).fingerprint()


@pytest.fixture
def fakes() -> Iterator[tuple[FakeBackend, FakeBackend]]:
    with FakeBackend() as a, FakeBackend() as b:
        yield a, b


def test_upgrading_one_member_of_two_under_traffic_stamps_and_routes_every_answer_truly(
        fakes: tuple[FakeBackend, FakeBackend]) -> None:
    a, b = fakes
    with ThreadedGateway(pool_config([a.url, b.url]), tenants_for_tests()) as gw, \
            Traffic(gw.url) as traffic:
        wait_until(lambda: len(traffic.answers) >= 40, "traffic before the upgrade")
        b.revision = NEW  # upgraded in place: the gateway learns it from its answers/refresh
        switched, at = len(traffic.answers), time.monotonic()
        # traffic long enough for the refresher to run several times, B answering at NEW
        wait_until(lambda: len(traffic.answers) >= switched + 140
                   and time.monotonic() - at >= 5 * REFRESH_S
                   and any(rev == NEW for _, rev, _ in b.served), "traffic after the upgrade")
        known = [getattr(m, "versions", None) for m in gw.gateway.upstreams["m"].members]
    answers = traffic.answers
    served = last_server(fakes)
    wrong_stamp, wrong_pin, refused = [], [], []
    for ans in answers:
        if ans.status != 200:
            refused.append(ans)
            continue
        revision = served[ans.rid]
        stamp = ans.stamp
        if (stamp["revision"] != revision[:12] or ans.models != {"m"}
                or ans.fingerprints != {fingerprint(revision, stamp["policy"])}):
            wrong_stamp.append((ans, revision))
        if ans.pin is not None and not revision.startswith(ans.pin):
            wrong_pin.append((ans, revision))
    assert wrong_stamp == [] and wrong_pin == []
    # the refresher knows each member's versions
    assert known == [ServedVersions(rev, "b" * 64, "c" * 64, "fake-engine/1")
                     for rev in (OLD, NEW)]
    # both revisions served, each to its own pins and to unpinned requests
    assert {served[x.rid] for x in answers if x.status == 200 and x.pin is None} == {OLD, NEW}
    assert traffic.ok(OLD, switched) >= 10 and traffic.ok(NEW, switched) >= 10
    # what was refused: only pins no member served (yet), with an honest Retry-After
    for ans in refused:
        assert ans.status == 503 and ans.code == "revision_unavailable", ans
        assert ans.pin is not None and (ans.pin == GONE[:9] or ans.pin.startswith("d")), ans
        assert ans.headers["retry-after"] == "1" and ans.headers["retry-after-ms"] == "200"
        assert "revision=" in ans.headers["x-sluice-resolved"]
    gone = [x for x in answers if x.pin == GONE[:9]]
    assert gone and all(x.status == 503 for x in gone)
    assert all(x.status == 200 for x in answers if x.pin is None or x.pin.startswith("a"))


def test_a_member_whose_versions_are_unknown_gets_no_pinned_request(
        fakes: tuple[FakeBackend, FakeBackend]) -> None:
    a, b = fakes
    b.revision = NEW
    with ThreadedGateway(pool_config([a.url, b.url]), tenants_for_tests()) as gw, \
            httpx.Client(timeout=30) as client:
        members = gw.gateway.upstreams["m"].members
        pinned_new = ask(client, gw.url, NEW[:8], False)
        assert pinned_new.status == 200 and pinned_new.stamp["revision"] == NEW[:12]
        assert last_server(fakes)[pinned_new.rid] == NEW
        b.__exit__()  # B goes down for its upgrade: its versions are no longer known
        wait_until(lambda: members[1].versions is None, "the refresher to forget B")
        refused = ask(client, gw.url, NEW[:8], True)
        assert refused.status == 503 and refused.code == "revision_unavailable"
        assert refused.headers["retry-after-ms"] == "200"
        for pin in (None, OLD[:8]):  # served by A (a request routed to B is retried there)
            ans = ask(client, gw.url, pin, True)
            assert ans.status == 200 and ans.stamp["revision"] == OLD[:12]
            assert last_server(fakes)[ans.rid] == OLD


def test_a_member_upgraded_under_a_pinned_request_leaves_it_to_one_still_serving_its_pin(
        fakes: tuple[FakeBackend, FakeBackend]) -> None:
    a, b = fakes
    with ThreadedGateway(pool_config([a.url, b.url]), tenants_for_tests()) as gw:
        members = gw.gateway.upstreams["m"].members

        async def keep_off_a(until: float) -> None:  # as if A had answered Retry-After
            members[0].not_before = until

        b.mode = "stall"  # B holds what it gets: routed while the gateway knows it as OLD
        gw.call(keep_off_a(float("inf")))
        results: dict[str | None, Answer] = {}

        def one(pin: str | None) -> None:
            with httpx.Client(timeout=30) as client:
                results[pin] = ask(client, gw.url, pin, pin is None)

        threads = [threading.Thread(target=one, args=(pin,)) for pin in (OLD[:8], None)]
        for t in threads:
            t.start()
        wait_until(lambda: len(b.bodies) == 2, "both requests to be held by B")
        gw.call(keep_off_a(0.0))
        b.revision, b.mode = NEW, "ok"  # upgraded before answering them
        b.release.set()
        for t in threads:
            t.join(30)
    served = last_server(fakes)
    pinned, unpinned = results[OLD[:8]], results[None]
    # the pinned request's answer from B (NEW) was not relayed: A answered it at OLD
    assert pinned.status == 200 and pinned.stamp["revision"] == OLD[:12]
    assert (pinned.rid, NEW) in {(rid, rev) for rid, rev, _ in b.served}
    assert served[pinned.rid] == OLD
    # the unpinned one is B's answer, stamped with what B serves now
    assert unpinned.status == 200 and unpinned.stamp["revision"] == NEW[:12]
    assert served[unpinned.rid] == NEW
    assert unpinned.fingerprints == {fingerprint(NEW, unpinned.stamp["policy"])}
