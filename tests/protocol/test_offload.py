"""The work pools: a pure fair core (checked against its invariants by hypothesis), the
asyncio pool around it (threads held by jobs that wait on events: no timing), and its
process flavour that parses large bodies."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import large_bodies, offload
from protocol.contract import MAX_MESSAGES
from protocol.errors import BadRequest, RateLimited, ServiceUnavailable
from protocol.offload import FairSlots, OffloadSettings, TokenizePool, Verdict, json_size_over
from tests.protocol import probe_jobs

# ---- the pure core ----------------------------------------------------------------------

TENANTS = ("a", "b", "c")
ops = st.lists(st.tuples(st.sampled_from(["admit", "finish", "withdraw"]),
                         st.sampled_from(TENANTS)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops=ops, workers=st.integers(1, 3), per_tenant=st.integers(1, 4),
       max_waiting=st.integers(0, 5))
def test_the_fair_core_keeps_its_invariants(ops: list[tuple[str, str]], workers: int,
                                            per_tenant: int, max_waiting: int) -> None:
    slots: FairSlots[int] = FairSlots(workers, per_tenant, max_waiting)
    running: dict[str, int] = {}  # a shadow: jobs running per tenant
    waiting: dict[str, list[int]] = {t: [] for t in TENANTS}
    next_job = 0
    for op, tenant in ops:
        if op == "admit":
            next_job += 1
            before = slots.active.get(tenant, 0)
            verdict = slots.admit(tenant, next_job)
            if verdict is Verdict.TENANT_FULL:
                assert before == per_tenant
            elif verdict is Verdict.POOL_FULL:
                assert slots.running == workers and slots.waiting == max_waiting
            elif verdict is Verdict.RUN:
                running[tenant] = running.get(tenant, 0) + 1
            else:
                waiting[tenant].append(next_job)
        elif op == "finish" and running.get(tenant):
            running[tenant] -= 1
            started = slots.finish(tenant)
            if started is not None:
                who, job = started
                assert waiting[who][0] == job  # FIFO within a tenant
                waiting[who].pop(0)
                running[who] = running.get(who, 0) + 1
        elif op == "withdraw" and waiting[tenant]:
            job = waiting[tenant].pop()
            assert slots.withdraw(tenant, job)
            assert not slots.withdraw(tenant, job)
        slots.check_invariants()
        assert slots.running == sum(running.values())
        assert slots.waiting == sum(len(w) for w in waiting.values())


def test_a_freed_thread_goes_round_robin_across_tenants() -> None:
    slots: FairSlots[str] = FairSlots(workers=1, per_tenant=10, max_waiting=10)
    assert slots.admit("a", "a0") is Verdict.RUN
    for job in ("a1", "a2", "a3"):
        assert slots.admit("a", job) is Verdict.WAIT
    assert slots.admit("b", "b1") is Verdict.WAIT  # queued after three of a's
    order = []
    tenant = "a"
    while (started := slots.finish(tenant)) is not None:
        tenant, job = started
        order.append(job)
    # the tenant that just ran goes behind the others: b waits for a's running job only
    assert order == ["b1", "a1", "a2", "a3"]


# ---- the asyncio pool -------------------------------------------------------------------

class Gate:
    """A job that holds its thread until released; ``started`` tells it is running."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> tuple[str, int]:
        self.started.set()
        if not self.release.wait(30):
            raise TimeoutError("never released")
        return "done", 0


def job(value: str, chars: int = 0) -> Callable[[], tuple[str, int]]:
    """A job that returns ``value`` at once, having tokenized ``chars`` characters."""
    return lambda: (value, chars)


async def running(gate: Gate) -> None:
    await asyncio.get_running_loop().run_in_executor(None, gate.started.wait, 30)


@pytest.fixture
def pool() -> Iterator[TokenizePool]:
    p = TokenizePool(OffloadSettings(workers=2, per_tenant=1, max_waiting=1))
    yield p
    p.close()


async def test_a_tenant_over_its_share_gets_429_while_another_proceeds(
        pool: TokenizePool) -> None:
    a = Gate()
    first = asyncio.create_task(pool.run("a", a))
    await running(a)
    with pytest.raises(RateLimited) as refused:
        await pool.run("a", job("more"))
    err = refused.value
    assert err.status == 429 and err.code == "tokenize_concurrency"
    assert err.retry_after_s is not None and err.retry_after_s > 0
    assert dict(err.headers())[b"retry-after"]
    assert await pool.run("b", job("b's")) == "b's"  # the other thread is free for b
    a.release.set()
    assert await first == "done"
    assert await pool.run("a", job("again")) == "again"  # the share is back
    assert pool.snapshot().refused_tenant == 1


async def test_a_full_pool_gets_503_with_retry_after(pool: TokenizePool) -> None:
    gates = [Gate(), Gate()]
    jobs = [asyncio.create_task(pool.run(t, g)) for t, g in zip("ab", gates, strict=True)]
    for g in gates:
        await running(g)
    queued = asyncio.create_task(pool.run("c", job("c's")))
    await asyncio.sleep(0)
    assert pool.snapshot().waiting == 1
    with pytest.raises(ServiceUnavailable) as refused:
        await pool.run("d", job("d's"))
    assert refused.value.code == "tokenizer_busy" and refused.value.retry_after_s
    for g in gates:
        g.release.set()
    assert await asyncio.gather(*jobs, queued) == ["done", "done", "c's"]
    snap = pool.snapshot()
    assert (snap.running, snap.waiting, snap.tenants) == (0, 0, 0)


async def test_a_cancelled_job_keeps_its_share_until_its_thread_is_done(
        pool: TokenizePool) -> None:
    a = Gate()
    first = asyncio.create_task(pool.run("a", a))
    await running(a)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    with pytest.raises(RateLimited):  # cancelling cannot be used to pile up work
        await pool.run("a", job("more"))
    a.release.set()
    for _ in range(10_000):
        if pool.snapshot().running == 0:
            break
        await asyncio.sleep(0.001)
    assert await pool.run("a", job("again")) == "again"


async def test_a_waiting_job_that_leaves_gives_its_place_back() -> None:
    pool = TokenizePool(OffloadSettings(workers=1, per_tenant=2, max_waiting=2))
    try:
        a = Gate()
        first = asyncio.create_task(pool.run("a", a))
        await running(a)
        waiting = asyncio.create_task(pool.run("b", job("b's")))
        await asyncio.sleep(0)
        assert pool.snapshot().waiting == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pool.snapshot().waiting == 0 and pool.snapshot().tenants == 1
        a.release.set()
        assert await first == "done"
        assert await pool.run("b", job("b's")) == "b's"
    finally:
        pool.close()


async def test_the_event_loop_runs_while_a_long_job_holds_a_thread(pool: TokenizePool) -> None:
    a = Gate()
    long_job = asyncio.create_task(pool.run("a", a))
    await running(a)
    small = await asyncio.sleep(0, "small")  # the loop is free meanwhile
    assert small == "small" and not long_job.done()
    a.release.set()
    assert await long_job == "done"


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        OffloadSettings(workers=0)
    with pytest.raises(ValueError):
        OffloadSettings(per_tenant=0)


async def test_a_thread_trims_after_a_job_that_tokenized_trim_chars_or_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[str] = []

    def release() -> bool:
        trims.append(threading.current_thread().name)
        return True

    monkeypatch.setattr(offload, "release_memory", release)
    pool = TokenizePool(OffloadSettings(workers=1, trim_chars=1000))
    try:
        assert await pool.run("a", job("small", 999)) == "small"
        assert trims == []
        assert await pool.run("a", job("large", 1000)) == "large"
        assert len(trims) == 1 and trims[0].startswith("sluice-tokenize")  # in the worker
    finally:
        pool.close()


def test_json_size_over_stops_early_and_survives_depth() -> None:
    assert not json_size_over({"a": "x" * 10}, 100)
    assert json_size_over({"a": "x" * 100}, 100)
    assert json_size_over({"x" * 101: 1}, 100)  # keys count too
    assert json_size_over(list(range(10**6)), 100)
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    assert json_size_over(deep, 1000) and not json_size_over(deep, 10**6)


def test_json_size_over_reads_exact_json_types_only() -> None:
    class Sneaky(list[str]):
        def __iter__(self) -> Iterator[str]:
            raise AssertionError("a subclass's methods never run on the loop")

    assert not json_size_over(Sneaky(["x" * 1000]), 100)
    assert json_size_over(("x" * 60, ["y" * 60]), 100)  # a tuple groups the values


# ---- a pool of processes: large bodies parsed off the loop --------------------------------

def pid_job() -> tuple[int, int]:
    return os.getpid(), 0


def pid_after(seconds: float) -> tuple[int, int]:
    time.sleep(seconds)
    return os.getpid(), 0


def die_job() -> tuple[None, int]:
    os._exit(3)  # the worker process dies mid-job (killed, out of memory)


@pytest.fixture
def parsing() -> Iterator[offload.WorkPool]:
    p = large_bodies.parse_pool()
    yield p
    p.close()


async def test_a_parse_pool_parses_in_another_process_and_refuses_there(
        parsing: offload.WorkPool) -> None:
    assert await parsing.run("a", pid_job) != os.getpid()
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * 1000}]}
    assert await parsing.run("a", large_bodies.parse_job(json.dumps(body).encode())) == body
    many = json.dumps({"messages": [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)})
    with pytest.raises(BadRequest) as refused:  # refused in the worker: the error crosses
        await parsing.run("a", large_bodies.parse_job(many.encode()))
    assert (refused.value.status, refused.value.param) == (400, "messages")
    assert refused.value.code == "invalid_value"
    with pytest.raises(BadRequest) as bad:
        await parsing.run("a", large_bodies.parse_job(b'{"messages": [{"content": "\\ud800"}]}'))
    assert bad.value.code == "invalid_unicode" and bad.value.param == "messages[0].content"
    snap = parsing.snapshot()
    assert (snap.running, snap.waiting, snap.tenants) == (0, 0, 0)


async def test_a_dead_parse_worker_is_a_503_and_the_next_job_gets_a_new_one(
        parsing: offload.WorkPool) -> None:
    # both workers started first: the executor starts one when a job finds none idle, and
    # CPython 3.11's starting one while another dies races in its own thread
    first = set(await asyncio.gather(parsing.run("a", functools.partial(pid_after, 0.3)),
                                     parsing.run("b", functools.partial(pid_after, 0.3))))
    assert len(first) == large_bodies.PARSE_WORKERS
    with pytest.raises(ServiceUnavailable) as refused:
        await parsing.run("a", die_job)
    assert refused.value.code == "large_bodies_busy" and refused.value.retry_after_s
    assert await parsing.run("a", pid_job) not in (*first, os.getpid())
    snap = parsing.snapshot()
    assert (snap.running, snap.tenants, snap.refused_full) == (0, 0, 1)


async def test_a_parse_pool_refuses_a_tenant_past_its_share_with_its_own_words() -> None:
    p = offload.WorkPool(OffloadSettings(workers=1, per_tenant=1, max_waiting=0),
                         processes=True, wording=large_bodies.PARSE)
    try:
        slow = asyncio.create_task(p.run("a", functools.partial(sleep_job, 0.5)))
        await asyncio.sleep(0)
        with pytest.raises(RateLimited) as refused:
            await p.run("a", pid_job)
        assert refused.value.code == "too_many_large_bodies"
        assert "large request bodies" in refused.value.message
        with pytest.raises(ServiceUnavailable) as full:
            await p.run("b", pid_job)
        assert full.value.code == "large_bodies_busy"
        assert await slow == 0.5
    finally:
        p.close()


def sleep_job(seconds: float) -> tuple[float, int]:
    time.sleep(seconds)
    return seconds, 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) is gone too
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:  # reaped meanwhile (ENOENT, or ESRCH mid-read)
        return False
    return state != "Z"


def gone_within(pids: set[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


SERVER = """
import asyncio, functools, sys
from protocol import large_bodies
from tests.protocol.test_offload import pid_after

async def main():
    pool = large_bodies.parse_pool()
    pids = await asyncio.gather(*(pool.run(str(i), functools.partial(pid_after, 0.3))
                                  for i in range(large_bodies.PARSE_WORKERS)))
    print(*pids, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_workers_leave_when_the_server_is_killed() -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE,
                              cwd=Path(__file__).resolve().parents[2], text=True)
    try:
        assert server.stdout is not None
        workers = {int(p) for p in server.stdout.readline().split()}
        assert len(workers) == large_bodies.PARSE_WORKERS and all(alive(p) for p in workers)
    finally:
        server.kill()  # SIGKILL: nothing of the server's runs after it
        server.wait()
    assert gone_within(workers, 30), "orphaned parse workers"


async def test_close_and_a_dead_worker_stop_every_worker(parsing: offload.WorkPool) -> None:
    first = set(await asyncio.gather(parsing.run("a", functools.partial(pid_after, 0.3)),
                                     parsing.run("b", functools.partial(pid_after, 0.3))))
    with pytest.raises(ServiceUnavailable):
        await parsing.run("a", die_job)
    assert await asyncio.to_thread(gone_within, first, 30)  # the survivor too
    second = set(await asyncio.gather(parsing.run("a", functools.partial(pid_after, 0.3)),
                                      parsing.run("b", functools.partial(pid_after, 0.3))))
    parsing.close()
    assert await asyncio.to_thread(gone_within, second, 30)


@pytest.mark.parametrize("warmed", [False, True])
async def test_warming_imports_the_parse_module_in_every_worker(warmed: bool) -> None:
    pool = large_bodies.parse_pool()
    try:
        if warmed:
            large_bodies.warm(pool)
        # as many jobs at once as workers: each lands on its own worker
        loaded = await asyncio.gather(*(
            pool.run(str(i), functools.partial(probe_jobs.loaded_after, 0.3))
            for i in range(large_bodies.PARSE_WORKERS)))
        assert loaded == [warmed] * large_bodies.PARSE_WORKERS
    finally:
        pool.close()
