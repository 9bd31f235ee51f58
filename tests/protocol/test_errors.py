"""What a server keeps of an error after the request: ``detached``."""

from __future__ import annotations

import gc
import weakref

from protocol.errors import PayloadTooLarge, RateLimited, RevisionMismatch, detached


class Body(dict[str, object]):
    """A request body that can be watched (a weakref) while it is freed."""


def refuse(body: Body) -> None:
    try:
        raise KeyError("the cause")
    except KeyError as exc:
        raise PayloadTooLarge("too long", "messages", code="prompt_too_long") from exc


def test_a_kept_error_holds_no_frame_so_refcounting_frees_the_body() -> None:
    kept: list[PayloadTooLarge] = []
    body = Body(messages=["x" * 1000])
    watch = weakref.ref(body)
    gc.disable()  # only reference counting: a cycle would keep the body
    try:
        try:
            refuse(body)
        except PayloadTooLarge as err:
            kept.append(detached(err))
            assert err.__traceback__ is not None and err.__cause__ is not None  # untouched
        del body
        assert watch() is None
    finally:
        gc.enable()
    (copy,) = kept
    assert copy.__traceback__ is None and copy.__cause__ is None and copy.__context__ is None
    assert (copy.status, copy.message, copy.param, copy.code) == (413, "too long", "messages",
                                                                 "prompt_too_long")


def test_detached_copies_keep_what_the_answer_needs() -> None:
    limited = RateLimited("slow down", code="tokenize_concurrency", retry_after_s=2.5)
    limited.extra_headers.append((b"x-ratelimit-limit-requests", b"10"))
    copy = detached(limited)
    assert copy is not limited and copy.headers() == limited.headers()
    assert copy.body() == limited.body()
    pinned = detached(RevisionMismatch("wrong revision"))
    assert pinned.param == "model" and pinned.should_retry is False
