"""The auth-keys benchmark's parts that need no gateway: the tenants files it writes, the
keys its requests carry and its verdict (the run itself is `python -m loadtest.auth_keys`,
not part of the suite)."""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import pytest
import yaml

from gateway.config import TenantsFile
from gateway.tenants import KeyRing, hash_key
from loadtest import auth_keys
from loadtest.load_client import Sample
from loadtest.measure import Stats

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# the C loader when PyYAML has it: the 100,000-key file takes ~5 s in the pure-Python one
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load(keys: int, per_tenant: int = auth_keys.KEYS_PER_TENANT) -> tuple[str, TenantsFile]:
    text = auth_keys.tenants_yaml(keys, per_tenant)
    return text, TenantsFile.model_validate(yaml.load(text, Loader=LOADER))


@pytest.mark.parametrize(("keys", "sizes"), [
    (auth_keys.SMALL_KEYS, [10]),
    (1_050, [100] * 10 + [50]),
    (100_000, [100] * 1_000),  # the default large file
])
def test_the_tenants_file_is_valid_and_holds_every_key_as_a_digest_only(
        keys: int, sizes: list[int]) -> None:
    text, tenants = load(keys)
    assert [len(t.keys) for t in tenants.tenants] == sizes
    stored = [k for t in tenants.tenants for k in t.keys]
    assert all(DIGEST.fullmatch(k) for k in stored)
    # the gateway's own hash of each bench key, in order, and no key in clear anywhere
    assert stored == [hash_key(auth_keys.bench_key(i)) for i in range(keys)]
    assert "sk-" not in text
    assert all(t.models == ["fake"] for t in tenants.tenants)


def test_every_request_key_authenticates_and_others_do_not() -> None:
    _, tenants = load(1_050)
    ring = KeyRing(tenants)
    assert len(ring) == 1_050
    chosen = auth_keys.request_keys(1_050)
    for i in chosen:
        tenant = ring.lookup(auth_keys.bench_key(i).encode())
        assert tenant is not None and tenant.id == f"auth-{i // 100:05d}"
    assert ring.lookup(auth_keys.bench_key(1_050).encode()) is None


def test_request_keys_spread_over_the_key_set() -> None:
    chosen = auth_keys.request_keys(100_000)
    assert len(chosen) == auth_keys.REQUEST_KEYS
    assert chosen[:3] == [0, 50_000, 99_999]  # first, middle, last, then random ones
    assert all(0 <= i < 100_000 for i in chosen)
    assert len(set(chosen)) > 50
    assert chosen == auth_keys.request_keys(100_000)  # seeded: the same every run
    small = auth_keys.request_keys(auth_keys.SMALL_KEYS)
    assert small[:3] == [0, 5, 9] and set(small) <= set(range(10))


def test_bench_keys_look_like_the_admin_apis() -> None:
    key = auth_keys.bench_key(0)
    assert re.fullmatch(r"sk-[A-Za-z0-9_-]{43}", key)
    assert len({auth_keys.bench_key(i) for i in range(1000)}) == 1000


async def test_the_pool_takes_turns_among_its_keys() -> None:
    seen: list[str] = []
    handlers: set[asyncio.Task[None]] = set()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                headers = dict(line.split(": ", 1) for line in head.split("\r\n")[1:]
                               if ": " in line)
                await reader.readexactly(int(headers["content-length"]))
                seen.append(headers["authorization"].removeprefix("Bearer "))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the pool closed the connection
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = auth_keys.keyed_pool(port, [0, 5, 9])
    try:
        await pool.warm(6)  # as `interleaved` does: every send finds an idle connection
        for _ in range(6):
            pool.send(Sample(due=0.0))
        await pool.drain(5.0)
        assert [s.status for s in pool.take()] == [200] * 6
        assert pool.connecting == 0
    finally:
        await pool.close()
        server.close()
        await asyncio.gather(*handlers)
    assert Counter(seen) == {auth_keys.bench_key(i): 2 for i in (0, 5, 9)}


def stats(p50: float, errors: int = 0, n: int = 1000) -> Stats:
    return Stats(n=n, errors=errors, error_kinds={"HTTP 401": errors} if errors else {},
                 e2e_p50_ms=p50, e2e_p99_ms=p50 * 4, ttft_p50_ms=p50, ttft_p99_ms=p50 * 4,
                 lag_p99_ms=1.0)


@pytest.mark.parametrize(("small", "big", "ratio", "ok"), [
    (stats(1.50), stats(1.57), 1.0467, True),
    (stats(1.50), stats(1.40), 0.9333, True),
    (stats(1.50), stats(1.59), 1.06, False),
    (stats(1.50), stats(1.50, errors=20), 1.0, False),  # 2 % errors: the run does not count
    (stats(float("nan"), errors=1000), stats(1.50), None, None),  # nothing to compare
])
def test_the_p50_ratio_is_judged_against_1_05(small: Stats, big: Stats, ratio: float | None,
                                              ok: bool | None,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    [judged] = auth_keys.judge(small, big, "100000 keys")
    if ratio is None:
        assert judged["value"] != judged["value"]  # NaN
    else:
        assert judged["value"] == pytest.approx(ratio, abs=1e-4)
    assert judged["pass"] is ok
    out = capsys.readouterr().out
    assert {True: "PASS", False: "MISS", None: "n/a"}[ok] in out


@pytest.mark.parametrize("argv", [["--keys", "0"], ["--keys-per-tenant", "0"],
                                  ["--rate", "0"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        auth_keys.main(argv)
    assert exc.value.code == 2
