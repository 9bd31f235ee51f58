"""Error shape and headers, request ids, body limits and the Starlette error handlers."""

from __future__ import annotations

import json
import logging

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from protocol.errors import (
    ApiError,
    BadRequest,
    RevisionMismatch,
    ServiceUnavailable,
    retry_after_headers,
)
from protocol.http import (
    LimitedBody,
    clean_request_id,
    error_response,
    exception_handlers,
    parse_json_object,
)


@pytest.mark.parametrize(("wait_s", "seconds", "ms"), [
    (0.0, b"1", b"1"), (-3.0, b"1", b"1"), (0.0004, b"1", b"1"), (0.1, b"1", b"100"),
    (0.1001, b"1", b"101"), (1.0, b"1", b"1000"), (1.0005, b"2", b"1001"),
    (59.9999, b"60", b"60000"), (86400.0, b"86400", b"86400000"),
])
def test_retry_after_rounds_up_and_the_two_headers_agree(wait_s: float, seconds: bytes,
                                                         ms: bytes) -> None:
    assert retry_after_headers(wait_s) == [(b"retry-after", seconds), (b"retry-after-ms", ms)]
    assert int(seconds) == -(-int(ms) // 1000)


def test_error_headers_and_body() -> None:
    err = ServiceUnavailable("full", "queue", retry_after_s=2.5, should_retry=True)
    err.extra_headers = [(b"x-ratelimit-limit-requests", b"10")]
    assert err.headers() == [(b"retry-after", b"3"), (b"retry-after-ms", b"2500"),
                             (b"x-should-retry", b"true"),
                             (b"x-ratelimit-limit-requests", b"10")]
    assert json.loads(err.json_bytes()) == {"error": {
        "message": "full", "type": "server_error", "code": "service_unavailable",
        "param": "queue"}}
    assert BadRequest("x").headers() == []
    pin = RevisionMismatch("moved")
    assert (pin.status, pin.code, pin.param) == (400, "revision_mismatch", "model")
    assert pin.headers() == [(b"x-should-retry", b"false")]


def test_error_response_keeps_every_header() -> None:
    err = ServiceUnavailable("busy", retry_after_s=1)
    err.extra_headers = [(b"x-a", b"1"), (b"x-a", b"2")]
    resp = error_response(err)
    assert resp.status_code == 503 and resp.media_type == "application/json"
    assert [v for k, v in resp.raw_headers if k == b"x-a"] == [b"1", b"2"]
    assert (b"retry-after-ms", b"1000") in resp.raw_headers
    assert (b"content-length", str(len(err.json_bytes())).encode()) in resp.raw_headers


@pytest.mark.parametrize(("raw", "clean"), [
    (b"abc-123", "abc-123"), (b"a b", "a b"), (b"x" * 128, "x" * 128), (None, None), (b"", None),
    (b"x" * 129, None), (b" lead", None), (b"trail ", None), (b"tab\there", None),
    (b"\xc3\xbc", None), (b"new\nline", None),
])
def test_request_id_rule(raw: bytes | None, clean: str | None) -> None:
    assert clean_request_id(raw) == clean


def test_body_limits() -> None:
    with pytest.raises(ApiError) as info:
        LimitedBody(10, b"11")
    assert info.value.status == 413 and "11 bytes" in info.value.message
    body = LimitedBody(10, "10")
    body.add(b"12345")
    body.add(b"67890")
    assert body.body() == b"1234567890"
    with pytest.raises(ApiError) as info:
        body.add(b"!")
    assert info.value.status == 413
    with pytest.raises(BadRequest) as bad:  # a bad header: a 400 naming it
        LimitedBody(10, b"not-a-number")
    assert bad.value.param == "content-length"


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b"[1]", b"", b"[" * 60_000, b"NaNx"])
def test_json_bodies_must_be_objects(raw: bytes) -> None:
    with pytest.raises(BadRequest) as info:
        parse_json_object(raw)
    assert info.value.code == "invalid_json"
    assert parse_json_object(b' {"a": 1} ') == {"a": 1}


def test_exception_handlers() -> None:
    async def boom(request: Request) -> Response:
        request.scope.setdefault("state", {})["request_id"] = "rid-1"
        raise RuntimeError("secret detail")

    app = Starlette(routes=[Route("/boom", boom, methods=["GET"])],
                    exception_handlers=exception_handlers(logging.getLogger("test")))
    with TestClient(app, raise_server_exceptions=False) as client:
        missing = client.get("/nowhere")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"
        wrong = client.post("/boom")
        assert wrong.status_code == 405
        assert wrong.json()["error"] == {"message": "POST is not allowed on /boom",
                                         "type": "invalid_request_error",
                                         "code": "method_not_allowed", "param": None}
        bug = client.get("/boom")
        assert bug.status_code == 500
        err = bug.json()["error"]
        assert err["code"] == "internal_error" and "secret" not in err["message"]
        assert "RuntimeError" in err["message"] and "rid-1" in err["message"]
