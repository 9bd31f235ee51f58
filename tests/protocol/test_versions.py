"""The x-sluice-resolved header and system_fingerprint: frozen bytes, and read back."""

from __future__ import annotations

import pytest

from protocol.versions import ResolvedVersions, ServedVersions, parse_header, short

TINY = ServedVersions("a" * 40, "b" * 64, "c" * 64, "sluice-engine/0.1.0")
NO_TEMPLATE = ServedVersions("main", "ab" * 32, None, "e/1")


# The figures below were computed by the code this module replaced (backend/engine/versions.py
# and gateway/stamp.py): clients compare fingerprints, so they may never move.
@pytest.mark.parametrize(("resolved", "header", "fp"), [
    (ResolvedVersions("sluice-tiny", TINY),
     ("model=sluice-tiny; revision=aaaaaaaaaaaa; tokenizer=bbbbbbbbbbbb; "
     "chat_template=cccccccccccc; engine=sluice-engine/0.1.0"), "fp_de690141ca81"),
    (ResolvedVersions("sluice-tiny", TINY, "pol-v3"),
     ("model=sluice-tiny; revision=aaaaaaaaaaaa; tokenizer=bbbbbbbbbbbb; "
     "chat_template=cccccccccccc; engine=sluice-engine/0.1.0; policy=pol-v3"),
     "fp_c9a42f5fc159"),
    (ResolvedVersions("sluice-tiny", TINY, ""),
     ("model=sluice-tiny; revision=aaaaaaaaaaaa; tokenizer=bbbbbbbbbbbb; "
     "chat_template=cccccccccccc; engine=sluice-engine/0.1.0; policy="), "fp_441e458a31b5"),
    (ResolvedVersions("m", NO_TEMPLATE),
     "model=m; revision=main; tokenizer=abababababab; chat_template=none; engine=e/1",
     "fp_671153d4041e"),
    (ResolvedVersions("m", NO_TEMPLATE, "pol-v3"),
     ("model=m; revision=main; tokenizer=abababababab; chat_template=none; engine=e/1; "
     "policy=pol-v3"), "fp_91e8ae64e3ba"),
    (ResolvedVersions("mödel", ServedVersions("", "none", "", "x")),
     "model=mödel; revision=; tokenizer=none; chat_template=; engine=x", "fp_283b7b331854"),
    (ResolvedVersions("mödel", ServedVersions("", "none", "", "x"), "pol-v3"),
     "model=mödel; revision=; tokenizer=none; chat_template=; engine=x; policy=pol-v3",
     "fp_8835925b9338"),
])
def test_header_and_fingerprint_are_byte_identical_to_before(
        resolved: ResolvedVersions, header: str, fp: str) -> None:
    assert resolved.header_value() == header
    assert resolved.fingerprint() == fp


def test_fingerprint_is_sensitive_to_every_field() -> None:
    base = ResolvedVersions("m", TINY, "p")
    prints = {base.fingerprint(), ResolvedVersions("m", TINY).fingerprint(),
              ResolvedVersions("n", TINY, "p").fingerprint(),
              ResolvedVersions("m", TINY, "q").fingerprint()}
    for name in ("revision", "tokenizer", "chat_template", "engine"):
        fields = {**base.as_dict(), name: "x"}
        served = ServedVersions(fields["revision"] or "", fields["tokenizer"] or "",
                                fields["chat_template"], fields["engine"] or "")
        prints.add(ResolvedVersions("m", served, "p").fingerprint())
    prints.add(ResolvedVersions("m", ServedVersions(TINY.revision, TINY.tokenizer, None,
                                                    TINY.engine), "p").fingerprint())
    assert len(prints) == 9


@pytest.mark.parametrize("resolved", [
    ResolvedVersions("sluice-tiny", TINY), ResolvedVersions("m", NO_TEMPLATE, "pol-v3"),
    ResolvedVersions("a@b=c", ServedVersions("r", "t", "", "sluice-engine/1"), ""),
])
def test_header_round_trip(resolved: ResolvedVersions) -> None:
    back = ResolvedVersions.from_header(resolved.header_value())
    assert back.header_value() == resolved.header_value()
    assert back.model == resolved.model and back.policy == resolved.policy
    v, w = back.versions, resolved.versions
    assert (v.revision, v.tokenizer, v.chat_template, v.engine) == (
        short(w.revision), short(w.tokenizer), None if w.chat_template is None
        else short(w.chat_template), w.engine)


@pytest.mark.parametrize("value", ["", "model", "model=m; model=n", "=x",
                                   "model=m; revision=r; tokenizer=t; engine=e"])
def test_malformed_headers_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        ResolvedVersions.from_header(value)


def test_parse_header_keeps_order_and_values() -> None:
    assert parse_header("model=m; revision=abc; engine=fake") == {
        "model": "m", "revision": "abc", "engine": "fake"}


def test_short() -> None:
    assert short("ab" * 32) == "ab" * 6
    assert short("main") == "main" and short("a" * 12) == "a" * 12
    assert short("g" * 40) == "g" * 40  # not hex
    assert short(None) == "none"


def test_served_versions_from_a_report_and_pins() -> None:
    served = ServedVersions.from_report({"revision": "abcdef123456", "tokenizer": "",
                                         "chat_template": 3, "engine": "e"})
    assert served == ServedVersions("abcdef123456", "unknown", None, "e")
    assert served.revision_matches("abcdef1") and served.revision_matches("abcdef123456")
    assert not served.revision_matches("abcdef") and not served.revision_matches("")
    assert not served.revision_matches("abcdef2")


def test_a_pin_refusal_says_a_short_pin_is_short_even_when_it_is_a_prefix() -> None:
    served = ServedVersions("776330" + "ab" * 29, "t", None, "e")
    short_pin = served.pin_refusal("m", "776330")
    assert short_pin == ("the model 'm' is served at revision '776330ababab'; a pin needs "
                         "at least 7 hex characters of the revision (or all of it), and "
                         "'776330' has 6")
    assert "at least 7 hex characters" in served.pin_refusal("m", "deadbe")
    assert served.pin_refusal("m", "deadbeef") == ("the model 'm' is served at revision "
                                                   "'776330ababab', not 'deadbeef'")


def test_as_dict_is_the_reported_resolved_object() -> None:
    resolved = ResolvedVersions("m", NO_TEMPLATE)
    assert resolved.as_dict() == {"model": "m", "revision": "main", "tokenizer": "ab" * 32,
                                  "chat_template": None, "engine": "e/1"}
    assert ServedVersions.from_report(resolved.as_dict()) == NO_TEMPLATE
    assert ResolvedVersions("m", NO_TEMPLATE, "p").as_dict()["policy"] == "p"
