"""`sluice tenants` usage errors: a bad limit names its flag and what the flag takes, before
anything is sent (no gateway needed)."""

from __future__ import annotations

import pytest

from gateway.tenants_cli import main as tenants_main


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        tenants_main(["update", "acme", *argv])
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(("flag", "value", "least"), [
    ("--tpm", "abc", 0), ("--rpm", "1.5", 0), ("--tpd", "-1", 0), ("--tpm-month", "", 0),
    ("--max-concurrency", "lots", 0), ("--max-queued", "-3", 0),
    # caps: 0 is not a cap the API accepts (a request of 0 bytes or tokens)
    ("--max-body-bytes", "0", 1), ("--max-prompt-tokens", "1e3", 1), ("--max-tokens", "0", 1),
])
def test_a_bad_limit_names_the_flag_and_what_it_takes(
        capsys: pytest.CaptureFixture[str], flag: str, value: str, least: int) -> None:
    assert usage_error(capsys, flag, value).endswith(
        f"argument {flag}: expected a whole number >= {least} or 'unlimited', got {value!r}")


def test_good_limits_parse(monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SLUICE_ADMIN_KEY", raising=False)  # stops at the key, after parsing
    assert tenants_main(["update", "acme", "--tpm", "0", "--rpm", "UNLIMITED",
                         "--max-tokens", "1", "--max-queued", "none"]) == 2
    assert "SLUICE_ADMIN_KEY" in capsys.readouterr().err
