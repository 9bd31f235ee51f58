"""The engine in a process of its own (``AsyncEngine`` over a ``ProcessTransport``): same
outputs as the engine driven directly, aborts that free blocks, errors that keep their type,
and no orphan process."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.engine.async_engine import AsyncEngine, RequestStream
from backend.engine.config import EngineConfig
from backend.engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError
from backend.engine.process_transport import ProcessTransport
from backend.engine.sampling import SamplingParams
from backend.engine.wire import error_from_wire, error_to_wire
from modelfiles.errors import UnsupportedModelError

REPO_ROOT = Path(__file__).resolve().parents[3]


def config(cache: Path, **kw: object) -> EngineConfig:
    return EngineConfig(model="tiny", cache_dir=str(cache), num_threads=1, **kw)  # type: ignore[arg-type]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


async def started(cache: Path, **kw: object) -> AsyncEngine:
    transport = await asyncio.to_thread(ProcessTransport.from_config, config(cache, **kw))
    engine = AsyncEngine(transport)
    await engine.start()
    return engine


def proc_of(engine: AsyncEngine) -> subprocess.Popen[bytes]:
    assert isinstance(engine.transport, ProcessTransport)
    return engine.transport.proc


def pid_of(engine: AsyncEngine) -> int:
    assert engine.info is not None
    return engine.info.pid


async def decoding(engine: AsyncEngine, request_id: str) -> RequestStream:
    """A long greedy request that has produced its first token, and its stream."""
    stream = await engine.generate(request_id, [5, 6, 7], greedy(2000))
    async for _ in stream:
        break
    return stream


async def wait_idle(engine: AsyncEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = engine.state()
        if st.running == 0 and st.waiting == 0 and st.kv_blocks_free == st.kv_blocks_total:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.state()}")


async def test_outputs_equal_the_engine_driven_directly(tiny_cache_dir: Path) -> None:
    from backend.engine.builder import build_engine

    prompts = [[5, 6, 7, 8], [100, 200, 300], list(range(40, 90)), [9] * 20]
    lengths = [12, 30, 7, 20]
    parts = build_engine(config(tiny_cache_dir))
    core = parts.core
    expected: dict[str, list[int]] = {}
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        core.add_request(f"r{i}", p, greedy(n))
        expected[f"r{i}"] = []
        while core.has_work():
            for d in core.step():
                expected[d.request_id].extend(d.token_ids)

    engine = await started(tiny_cache_dir)
    try:
        info = engine.info
        assert info is not None and info.model_name == "sluice-tiny"
        assert info.versions == parts.versions  # the engine process's, as built here
        assert info.tokenizer.sha256 == parts.tokenizer.sha256
        assert info.pid != os.getpid() and pid_alive(info.pid)
        assert info.limits == core.limits

        async def run(i: int) -> tuple[list[int], str, str | None]:
            stream = await engine.generate(f"r{i}", prompts[i], greedy(lengths[i]))
            ids: list[int] = []
            text = ""
            reason = None
            async for d in stream:
                ids.extend(d.token_ids)
                text += d.text
                reason = d.finish_reason
                if d.finished:
                    assert d.metrics is not None and d.metrics.first_token_time is not None
                    assert d.num_prompt_tokens == len(prompts[i])
            return ids, text, reason

        results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
        for i, (ids, text, reason) in enumerate(results):
            assert ids == expected[f"r{i}"]
            assert text == info.tokenizer.decode(ids)
            assert reason == "length"
        await wait_idle(engine)
        assert engine.state().generated_tokens == sum(lengths)
    finally:
        await engine.shutdown()
    assert proc_of(engine).returncode == 0


async def test_abort_frees_the_blocks_in_the_engine_process(tiny_cache_dir: Path) -> None:
    engine = await started(tiny_cache_dir)
    try:
        streams = [await engine.generate(f"a{i}", [7 + i] * 30, greedy(500)) for i in range(8)]
        for s in streams[:4]:  # four mid-generation …
            n = 0
            async for _ in s:
                n += 1
                if n == 3:
                    break
        for s in streams:  # … and four still waiting or barely started
            await s.aclose()
        await wait_idle(engine, timeout=1.0)
        st = engine.state()
        assert st.aborted == 8
        assert st.max_tokens_after_abort <= 2
        engine.abort("no-such-request")  # a no-op
        await asyncio.sleep(0.05)
        assert engine.state().aborted == 8
    finally:
        await engine.shutdown()


async def test_bad_requests_raise_before_anything_is_sent(tiny_cache_dir: Path) -> None:
    engine = await started(tiny_cache_dir, max_model_len=64)
    try:
        with pytest.raises(PromptTooLongError):
            await engine.generate("long", [5] * 64, greedy(1))
        with pytest.raises(PromptTooLongError) as info:
            await engine.generate("long2", [5] * 60, greedy(10))
        assert info.value.param == "max_tokens"
        with pytest.raises(InvalidRequestError):
            await engine.generate("vocab", [10**9], greedy(1))
        assert engine.state().waiting == 0 and engine.state().steps == 0
    finally:
        await engine.shutdown()


def test_errors_cross_the_wire_with_their_type_and_parameter() -> None:
    err = error_from_wire(*error_to_wire("r", PromptTooLongError("too long", "prompt"))[1:])
    assert type(err) is PromptTooLongError and str(err) == "too long" and err.param == "prompt"
    err = error_from_wire(*error_to_wire("r", UnsupportedModelError("no such model"))[1:])
    assert type(err) is UnsupportedModelError and str(err) == "no such model"
    err = error_from_wire(*error_to_wire("r", RuntimeError("boom"))[1:])
    assert "RuntimeError: boom" in str(err)


async def test_shutdown_aborts_what_is_still_running(tiny_cache_dir: Path) -> None:
    engine = await started(tiny_cache_dir)
    stream = await decoding(engine, "s")
    await engine.shutdown()
    last = None
    async for d in stream:
        last = d
    assert last is not None and last.finish_reason == "abort"
    assert proc_of(engine).returncode == 0 and not engine.is_running
    with pytest.raises(EngineDeadError):
        await engine.generate("after", [5], greedy(1))


async def test_a_dead_engine_process_fails_open_streams(tiny_cache_dir: Path) -> None:
    engine = await started(tiny_cache_dir)
    try:
        stream = await decoding(engine, "d")
        os.kill(pid_of(engine), signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.generate("after", [5], greedy(1))
    finally:
        await engine.shutdown()


def test_a_checkpoint_the_engine_cannot_load_fails_the_start(tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["NotALlamaForCausalLM"]
    cfg["model_type"] = "not-a-llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    t0 = time.monotonic()
    with pytest.raises(UnsupportedModelError):
        ProcessTransport.from_config(EngineConfig(model=str(bad), num_threads=1))
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_the_engine_process_dies_with_its_parent(tiny_cache_dir: Path, how: str) -> None:
    script = f"""
import os, sys, time
from backend.engine.async_engine import RequestStream
from backend.engine.config import EngineConfig
from backend.engine.process_transport import ProcessTransport
e = ProcessTransport.from_config(EngineConfig(model="tiny", cache_dir={str(tiny_cache_dir)!r},
                                              num_threads=1))
print(e.info.pid, flush=True)
if {how == "exit"}:
    os._exit(0)  # no shutdown: the socket's end of file must end the child
time.sleep(60)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        if how == "sigkill":
            parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_the_engine_process_ignores_signals_sent_to_the_group(tiny_cache_dir: Path) -> None:
    async def main() -> None:
        engine = await started(tiny_cache_dir)
        try:
            os.kill(pid_of(engine), signal.SIGTERM)
            os.kill(pid_of(engine), signal.SIGINT)
            stream = await engine.generate("g", [5, 6], greedy(5))
            assert [d.num_output_tokens async for d in stream][-1] == 5
            assert engine.is_running
        finally:
            await engine.shutdown()
        assert proc_of(engine).returncode == 0

    asyncio.run(main())


async def test_abort_from_another_thread(tiny_cache_dir: Path) -> None:
    engine = await started(tiny_cache_dir)
    try:
        stream = await decoding(engine, "t")
        await asyncio.to_thread(engine.abort, "t")  # e.g. a garbage-collected stream
        last = None
        async with asyncio.timeout(5):
            async for d in stream:
                last = d
        assert last is not None and last.finish_reason == "abort"
        await wait_idle(engine, timeout=1.0)
    finally:
        await engine.shutdown()
    engine.abort("t")  # after shutdown: nothing to do, no error


async def test_streams_end_when_the_engine_dies_during_shutdown(tiny_cache_dir: Path) -> None:
    engine = await started(tiny_cache_dir)
    pid = pid_of(engine)
    stream = await decoding(engine, "h")
    os.kill(pid, signal.SIGSTOP)  # stuck: it cannot answer the shutdown …
    stopping = asyncio.create_task(engine.shutdown())
    await asyncio.sleep(0.3)
    os.kill(pid, signal.SIGKILL)  # … and then dies without its final deltas
    async with asyncio.timeout(15):
        await stopping
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
    assert not engine.is_running and proc_of(engine).returncode == -signal.SIGKILL
