"""`loadtest/dataset.py`: reading JSONL and ShareGPT files, counting their tokens, filters,
and the seeded order and sample.

Counts are checked against a real `sluice backend --model tiny` (its own process): an
entry's ``input_tokens`` must equal the ``usage.prompt_tokens`` the backend reports for the
same request. The target without a tokenize endpoint is a stdlib HTTP server in a thread
that answers 404 there and forwards chat completions to that backend, so the chat template
overhead fitted from ``usage.prompt_tokens`` is checked against real counts too.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import pytest
import tokenizers
from pydantic import ValidationError

from loadtest.dataset import DatasetError, DatasetSpec, Entry, prepare_dataset
from tests.backend.server.conftest import Backend, start_backend

REPO_ROOT = Path(__file__).resolve().parents[2]
DATASETS = REPO_ROOT / "configs" / "datasets"
MODEL = "sluice-tiny"
NOWHERE = "http://127.0.0.1:9"  # never contacted: the file fails, or counting is local


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from modelfiles.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="module")
def backend(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = start_backend(tmp_path_factory.mktemp("backend"))
    yield b
    b.stop()


class _Fake(BaseHTTPRequestHandler):
    """404 (``not_found`` in OpenAI's shape, as the gateway answers an unknown route) on
    every path but ``/v1/chat/completions``, which goes to ``upstream``; ``model_404``
    makes the tokenize 404 about the model instead."""

    upstream = ""
    model_404 = False

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/chat/completions" and self.upstream:
            resp = httpx.post(self.upstream + self.path, content=body,
                              headers={"content-type": "application/json"}, timeout=30)
            status, out = resp.status_code, resp.content
        elif self.model_404 and self.path == "/v1/tokenize":
            status, out = 404, json.dumps({"error": {
                "message": "no such model", "code": "model_not_found", "param": "model"}}
            ).encode()
        else:
            status, out = 404, json.dumps({"error": {
                "message": f"no route {self.path}", "code": "not_found"}}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


def _serve(upstream: str = "", model_404: bool = False) -> tuple[ThreadingHTTPServer, str]:
    handler = type("Handler", (_Fake,), {"upstream": upstream, "model_404": model_404})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def _prompt_tokens(b: Backend, e: Entry) -> int:
    """What the backend counts for the request this entry becomes."""
    body: dict[str, Any]
    if e.messages is not None:
        url, body = "/v1/chat/completions", {"messages": list(e.messages)}
    else:
        url, body = "/v1/completions", {"prompt": e.prompt}
    resp = httpx.post(b.url + url, json={"model": MODEL, "max_tokens": 1, **body}, timeout=30)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])


async def _local(spec: DatasetSpec, seed: int = 7,
                 api: Literal["chat", "completions"] = "completions",
                 ) -> tuple[list[Entry], dict[str, Any]]:
    """Prepared with the tiny tokenizer.json: completions never contact the target."""
    return await prepare_dataset(spec, api=api, seed=seed, base_url=NOWHERE, key=None,
                                 model=MODEL)


# -- counts against the real backend ---------------------------------------------------


async def test_target_counts_equal_the_backends_usage(backend: Backend, tiny_dir: Path,
                                                      ) -> None:
    spec = DatasetSpec(path=str(DATASETS / "sample.jsonl"))
    entries, info = await prepare_dataset(spec, api="chat", seed=1, base_url=backend.url + "/v1",
                                          key=None, model=MODEL)
    assert len(entries) == info["kept"] == info["read"] == 30
    assert info["tokens_counted_by"] == "target /v1/tokenize" and info["exact"] is True
    tok = tokenizers.Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    rows = [json.loads(line) for line in (DATASETS / "sample.jsonl").read_text().splitlines()]
    by_text = {json.dumps(r.get("messages") or [{"role": "user", "content": r["prompt"]}]): r
               for r in rows}
    for e in entries:
        assert e.exact and e.prompt is None and e.messages is not None
        assert e.input_tokens == _prompt_tokens(backend, e)
        row = by_text[json.dumps(list(e.messages))]
        answer = row.get("completion")
        expected = (len(tok.encode(answer, add_special_tokens=False).ids) if answer
                    else row.get("output_tokens"))
        assert e.output_tokens == expected


async def test_completions_counts_target_and_local(backend: Backend, tiny_dir: Path,
                                                   tmp_path: Path) -> None:
    rows = [json.loads(line) for line in (DATASETS / "sample.jsonl").read_text().splitlines()]
    prompts = [r for r in rows if "prompt" in r]
    path = _write(tmp_path / "prompts.jsonl", prompts)
    for tokenizer in (None, str(tiny_dir)):
        spec = DatasetSpec(path=str(path), tokenizer=tokenizer)
        entries, info = await prepare_dataset(spec, api="completions", seed=3,
                                              base_url=backend.url, key=None, model=MODEL)
        assert len(entries) == len(prompts) > 15
        assert info["exact"] is (tokenizer is None)
        for e in entries:
            assert e.messages is None and e.prompt is not None
            assert e.input_tokens == _prompt_tokens(backend, e)  # BOS included


async def test_local_tokenizer_chat_overhead(backend: Backend, tiny_dir: Path) -> None:
    """tokenizer.json plus the template overhead fitted from the backend's /v1/tokenize, and
    from usage.prompt_tokens behind a target without a tokenize endpoint: one-message and
    system + user prompts are exact on this template, longer conversations within 1."""
    server, url = _serve(upstream=backend.url)
    try:
        for base, source in ((backend.url, "/v1/tokenize"), (url, "usage.prompt_tokens")):
            spec = DatasetSpec(path="datasets/sample.jsonl", tokenizer=str(tiny_dir))
            entries, info = await prepare_dataset(spec, api="chat", seed=2, base_url=base,
                                                  key=None, model=MODEL,
                                                  base_dir=REPO_ROOT / "configs")
            assert info["tokens_counted_by"] == (f"tokenizer.json at {tiny_dir} (+ chat "
                                                 f"template overhead from the target's {source})")
            for e in entries:
                assert e.messages is not None and not e.exact
                actual = _prompt_tokens(backend, e)
                roles = [m["role"] for m in e.messages]
                if roles in (["user"], ["system", "user"]):
                    assert e.input_tokens == actual, roles
                else:
                    assert abs(e.input_tokens - actual) <= 1, roles
    finally:
        server.shutdown()
        server.server_close()


async def test_sharegpt(backend: Backend, tiny_dir: Path) -> None:
    data = json.loads((DATASETS / "sample-sharegpt.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    spec = DatasetSpec(path=str(DATASETS / "sample-sharegpt.json"), order="sequential")
    apis: tuple[Literal["chat", "completions"], ...] = ("chat", "completions")
    for api in apis:
        entries, info = await prepare_dataset(spec, api=api, seed=0,
                                              base_url=backend.url, key=None, model=MODEL)
        assert info["format"] == "sharegpt" and info["read"] == len(data) == 14
        assert info["kept"] == 12
        assert info["dropped"]["too_few_turns"] == 1  # one human turn alone
        assert info["dropped"]["no_answered_human_turn"] == 1  # gpt turns only
        for conv, e in zip(data, entries, strict=False):  # sequential: file order
            turns = conv["conversations"]
            human = next(t["value"] for t in turns if t["from"] == "human")
            answer = next(t["value"] for t in turns if t["from"] == "gpt")
            assert e.output_tokens == len(tok.encode(answer, add_special_tokens=False).ids)
            assert e.input_tokens == _prompt_tokens(backend, e)
            if api == "completions":
                assert e.prompt == human
            else:
                system = [{"role": "system", "content": t["value"]}
                          for t in turns if t["from"] == "system"]
                assert list(e.messages or ()) == [*system, {"role": "user", "content": human}]


# -- targets without a tokenize endpoint ----------------------------------------------------


async def test_no_tokenize_endpoint_asks_for_a_tokenizer(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"prompt": "hello"}])
    server, url = _serve()
    try:
        with pytest.raises(DatasetError, match="--tokenizer DIR"):
            await prepare_dataset(DatasetSpec(path=str(path)), api="chat", seed=0,
                                  base_url=url, key=None, model=MODEL)
    finally:
        server.shutdown()
        server.server_close()
    server, url = _serve(model_404=True)  # the route exists; the model does not
    try:
        with pytest.raises(RuntimeError, match="no such model") as info:
            await prepare_dataset(DatasetSpec(path=str(path)), api="chat", seed=0,
                                  base_url=url, key=None, model="nope")
        assert not isinstance(info.value, DatasetError)
    finally:
        server.shutdown()
        server.server_close()


async def test_cancel_mid_count_closes_the_connection(tmp_path: Path) -> None:
    """Cancelled while a tokenize request is in flight, prepare_dataset closes its client:
    the target sees the connection end (EOF), with no timing involved."""
    arrived, closed = threading.Event(), threading.Event()

    class Stall(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            arrived.set()
            if self.rfile.read(1) == b"":  # blocks until the client closes the connection
                closed.set()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stall)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path = _write(tmp_path / "d.jsonl", [{"prompt": "hello"}])
    try:
        task = asyncio.create_task(prepare_dataset(
            DatasetSpec(path=str(path)), api="chat", seed=0,
            base_url=f"http://127.0.0.1:{server.server_address[1]}", key=None, model=MODEL))
        assert await asyncio.to_thread(arrived.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(closed.wait, 30)
    finally:
        server.shutdown()
        server.server_close()


async def test_refused_entry_names_its_line(backend: Backend, tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"prompt": "fine"}, "\n",
                                         {"messages": [{"role": "narrator", "content": "x"}]}])
    with pytest.raises(DatasetError, match=r"d\.jsonl:3: the target refused"):
        await prepare_dataset(DatasetSpec(path=str(path)), api="chat", seed=0,
                              base_url=backend.url, key=None, model=MODEL)


# -- order, sample, filters (local tokenizer, no target) --------------------------------


async def test_order_and_sample_follow_the_seed(tiny_dir: Path, tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl",
                  [{"prompt": f"prompt number {k} " + "word " * k} for k in range(40)])

    def texts(entries: list[Entry]) -> list[str]:
        return [str(e.prompt) for e in entries]

    def spec(**kw: Any) -> DatasetSpec:
        return DatasetSpec(path=str(path), tokenizer=str(tiny_dir), **kw)

    file_order = [json.loads(x)["prompt"] for x in path.read_text().splitlines()]
    a, _ = await _local(spec(), seed=5)
    b, _ = await _local(spec(), seed=5)
    c, _ = await _local(spec(), seed=6)
    assert texts(a) == texts(b) and sorted(texts(a)) == sorted(file_order)
    assert texts(a) != texts(c) and texts(a) != file_order
    seq, _ = await _local(spec(order="sequential"), seed=5)
    assert texts(seq) == file_order
    s1, info = await _local(spec(sample=10), seed=5)
    s2, _ = await _local(spec(sample=10), seed=5)
    assert texts(s1) == texts(s2) == texts(a)[:10]  # the sample is the seeded order's head
    assert info["kept"] == info["counted"] == 10 and info["read"] == 40
    s3, _ = await _local(spec(sample=10, order="sequential"), seed=5)
    assert texts(s3) == [t for t in file_order if t in set(texts(s1))]  # same draw, file order
    big, _ = await _local(spec(sample=100), seed=5)
    assert len(big) == 40


async def test_filters_and_drop_counts(tiny_dir: Path, tmp_path: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    rows: list[Any] = [{"prompt": "word " * k, "output_tokens": 5 + k} for k in range(1, 31)]
    rows += [{"prompt": "no reference answer " * 3},
             {"prompt": "   "}, {"prompt": "x", "completion": ""}]
    path = _write(tmp_path / "d.jsonl", rows)
    # "word " is two tokens on the tiny tokenizer, plus BOS and the trailing space
    spec = DatasetSpec(path=str(path), tokenizer=str(tiny_dir), min_input_tokens=8,
                       max_input_tokens=45, max_output_tokens=20)
    entries, info = await _local(spec)
    for e in entries:
        assert 8 <= e.input_tokens <= 45
        assert e.input_tokens == len(tok.encode(str(e.prompt)).ids)
        assert e.output_tokens is None or e.output_tokens <= 20
    # the entry without a reference length passes the output filter
    assert sum(e.output_tokens is None for e in entries) == 1
    d = info["dropped"]
    assert d["empty_prompt"] == 1 and d["empty_answer"] == 1
    assert info["read"] == 33 and info["usable"] == 31 == info["counted"]
    assert info["kept"] + d["input_too_short"] + d["input_too_long"] \
        + d["output_too_long"] == 31
    assert d["input_too_short"] > 0 and d["input_too_long"] > 0 and d["output_too_long"] > 0
    inputs = [e.input_tokens for e in entries]
    assert info["input_tokens"]["p50"] == float(np.median(inputs))
    assert info["input_tokens"]["p99"] == float(np.percentile(inputs, 99))
    assert info["with_output_tokens"] == len(entries) - 1
    with pytest.raises(DatasetError, match="no entry left"):
        await _local(DatasetSpec(path=str(path), tokenizer=str(tiny_dir), min_input_tokens=999))


# -- the file and the spec --------------------------------------------------------------


@pytest.mark.parametrize(("rows", "api", "message"), [
    ([{"prompt": "a"}, "not json\n"], "chat", r"d\.jsonl:2: not JSON"),
    ([{"prompt": "a"}, "[1, 2]\n"], "chat", r"d\.jsonl:2: expected a JSON object"),
    ([{"prompt": "a", "messages": []}], "chat", r"d\.jsonl:1: give exactly one of"),
    ([{"messages": "hi"}], "chat", r"d\.jsonl:1: 'messages' must be a non-empty list"),
    ([{"messages": [{"role": "user"}]}], "chat", r"d\.jsonl:1: messages\[0\] needs"),
    ([{"prompt": 3}], "chat", r"d\.jsonl:1: 'prompt' must be a string"),
    ([{"prompt": "a", "output_tokens": 0}], "chat", r"'output_tokens' must be an integer"),
    ([{"prompt": "a", "output_tokens": 3, "max_tokens": 4}], "chat", "not both"),
    ([{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}],
     "completions", r"d\.jsonl:1: 2 messages cannot be a completions prompt"),
])
async def test_bad_jsonl_names_the_line(tmp_path: Path, rows: list[Any], api: str,
                                        message: str) -> None:
    path = _write(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError, match=message):
        await prepare_dataset(DatasetSpec(path=str(path)), api=api, seed=0,  # type: ignore[arg-type]
                              base_url=NOWHERE, key=None, model=MODEL)


@pytest.mark.parametrize(("text", "message"), [
    ('[{"conversations": [{"from": "human", "value": "a"},\n  oops]}]', r"d\.json:2: not JSON"),
    ('[{"id": "x", "conversations": [{"from": "human"}]}]',
     r"d\.json: entry 0 \(id 'x'\): conversations\[0\] needs"),
    ('[{"conversations": []}, {"conversations": [{"from": "alien", "value": "a"}]}]',
     r"d\.json: entry 1: conversations\[0\]: unknown 'from' 'alien'"),
    ('[{"messages": []}]', r"d\.json: entry 0: expected an object with a 'conversations'"),
])
async def test_bad_sharegpt_names_the_entry(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "d.json"
    path.write_text(text)
    with pytest.raises(DatasetError, match=message):
        await prepare_dataset(DatasetSpec(path=str(path)), api="chat", seed=0,
                              base_url=NOWHERE, key=None, model=MODEL)


async def test_missing_or_empty_file(tmp_path: Path, tiny_dir: Path) -> None:
    with pytest.raises(DatasetError, match=r"nope\.jsonl: no such file"):
        await prepare_dataset(DatasetSpec(path="nope.jsonl"), api="chat", seed=0,
                              base_url=NOWHERE, key=None, model=MODEL, base_dir=tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="no entries"):
        await prepare_dataset(DatasetSpec(path="empty.jsonl"), api="chat", seed=0,
                              base_url=NOWHERE, key=None, model=MODEL, base_dir=tmp_path)
    with pytest.raises(DatasetError, match="no tokenizer.json"):
        await _local(DatasetSpec(path=str(DATASETS / "sample.jsonl"), tokenizer=str(tmp_path)),
                     api="chat")


def test_spec_validation() -> None:
    with pytest.raises(ValidationError, match="min_input_tokens"):
        DatasetSpec(path="x", min_input_tokens=10, max_input_tokens=5)
    with pytest.raises(ValidationError):
        DatasetSpec(path="x", sample=0)
    with pytest.raises(ValidationError):
        DatasetSpec(path="x", shuffle=True)  # type: ignore[call-arg]
    assert DatasetSpec(path="x").format == "auto"


@pytest.mark.parametrize("data", ["sample-sharegpt.json", "sample.jsonl"])
def test_a_run_sends_the_dataset_with_exact_lengths(backend: Backend, tmp_path: Path,
                                                    data: str) -> None:
    """`sluice loadtest --dataset` end to end: the prompts sent are the entries, each
    request's planned input length is exactly what the backend counted, and a reference
    answer's length is the request's output length."""
    import os
    import subprocess
    import sys

    api: Literal["chat"] = "chat"
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "r"
    done = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "loadtest", "--target", backend.url,
         "--key", backend.api_key or "", "--concurrency", "2", "--requests", "8",
         "--api", api, "--dataset", str(repo / "configs" / "datasets" / data),
         "--dataset-order", "sequential", "--max-tokens", "4", "--out", str(out),
         "--no-progress"], cwd=repo, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(repo)}, check=False)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    details = json.loads((out / "details.json").read_text())
    entries, _ = asyncio.run(prepare_dataset(
        DatasetSpec(path=str(repo / "configs" / "datasets" / data), order="sequential"),
        api=api, seed=0, base_url=backend.url, key=backend.api_key, model="sluice-tiny"))
    assert len(rows) == 8 and details["dataset"]["kept"] == len(entries)
    for r in rows:
        e = entries[r["idx"] % len(entries)]
        assert r["outcome"] in ("success", "slo_miss"), r
        assert r["input_tokens"] == e.input_tokens == r["prompt_tokens"]
        want = e.output_tokens if e.output_tokens is not None else 4
        assert r["output_tokens"] == want
    assert details["calibration_error"]["mean_abs_pct"] == 0
    assert details["calibration_unreliable"] is False
