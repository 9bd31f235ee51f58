"""Keys: only hashes are stored, bad credentials get 401, and the compare has no early exit."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway import tenants as tenants_mod
from gateway.config import TenantEntry, TenantsFile
from gateway.tenants import KeyRing, Tenant, hash_key

from .conftest import TEST_KEY, ThreadedGateway, config_for, tenants_for_tests
from .fake_backend import FakeBackend

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def gw() -> Iterator[ThreadedGateway]:
    with FakeBackend() as fake, ThreadedGateway(config_for(fake.url), tenants_for_tests()) as g:
        yield g


@pytest.mark.parametrize("value", [
    None,  # no header
    "",  # empty header
    "Bearer",  # no key
    "Bearer ",  # empty bearer
    "Bearer    ",
    "Basic c2stdGVzdC1vbmU=",  # another scheme
    "sk-test-one",  # the key without the scheme
    "Bearer sk-test-on",  # a prefix of a real key
    "Bearer sk-test-one-and-more",
    "Bearer " + "x" * 5000,  # over-long
    "Bearer sk-test-\u00e9",  # non-ASCII
])
def test_bad_credentials_get_401(gw: ThreadedGateway, value: str | None) -> None:
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("GET", "/v1/models")):
        status, body = raw_request(gw.port, method, path, value)
        assert status == 401, (value, body)
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert TEST_KEY.encode() not in body


def raw_request(port: int, method: str, path: str, authorization: str | None) -> tuple[int, bytes]:
    """A request written byte by byte (httpx refuses some of the headers tested here)."""
    data = json.dumps(CHAT).encode() if method == "POST" else b""
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n".encode()
    if authorization is not None:
        head += b"authorization: " + authorization.encode("utf-8") + b"\r\n"
    head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    status = int(raw.split(b" ", 2)[1])
    return status, raw.split(b"\r\n\r\n", 1)[1]


def test_the_right_key_passes_any_case_of_the_scheme(gw: ThreadedGateway) -> None:
    for scheme in ("Bearer", "bearer", "BEARER"):
        resp = httpx.post(gw.url + "/v1/chat/completions", json=CHAT,
                          headers={"authorization": f"{scheme} {TEST_KEY}"})
        assert resp.status_code == 200


def _ring(n: int) -> tuple[KeyRing, list[str]]:
    keys = [f"sk-key-{i:05d}" for i in range(n)]
    entries = [TenantEntry(id=f"t{i}", keys=[hash_key(k)]) for i, k in enumerate(keys)]
    return KeyRing(TenantsFile(tenants=entries)), keys


def test_a_key_is_one_digest_lookup_however_many_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    tenants = {f"t{i}": Tenant.from_entry(TenantEntry(id=f"t{i}")) for i in range(10)}
    keys = [f"sk-key-{i:06d}" for i in range(100_000)]
    ring = KeyRing.from_records(tenants, ((hash_key(k), f"t{i % 10}")
                                          for i, k in enumerate(keys)))
    assert len(ring) == 100_000
    hashed: list[bytes] = []
    real = hashlib.sha256

    def counting(data: bytes) -> Any:
        hashed.append(data)
        return real(data)

    def scan(a: bytes, b: bytes) -> bool:
        raise AssertionError("a per-request scan of the stored digests")

    monkeypatch.setattr(hmac, "compare_digest", scan)
    monkeypatch.setattr(tenants_mod.hashlib, "sha256", counting)
    for key, expected in ((keys[0], "t0"), (keys[-1], "t9"), ("sk-missing", None)):
        hashed.clear()
        tenant = ring.lookup(key.encode())
        assert (tenant.id if tenant else None) == expected
        assert hashed == [key.encode()]  # the presented key hashed once, nothing else


def test_a_ring_from_records_finds_its_keys_and_drops_orphans() -> None:
    tenant = Tenant.from_entry(TenantEntry(id="a"))
    ring = KeyRing.from_records({"a": tenant}, [(hash_key("sk-a"), "a"),
                                                (hash_key("sk-orphan"), "gone")])
    assert len(ring) == 1 and ring.lookup(b"sk-a") is tenant
    assert ring.lookup(b"sk-orphan") is None


def test_keys_are_never_stored_in_the_clear() -> None:
    with pytest.raises(ValueError, match="sha256"):
        TenantEntry(id="x", keys=["sk-plaintext"])
    assert hash_key("sk-demo-alpha") == (
        "sha256:d65dbed0e4fe9a841da92d82a1b8a547f77050f26679ec1e3b664c30fa346b0c")
