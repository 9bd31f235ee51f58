"""The resolved versions, built from the tiny checkpoint's files, and the prefix-cache root."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from backend.engine.versions import engine_version, prefix_cache_salt
from modelfiles.tiny_model import TINY_MODEL_NAME, write_tiny_model
from modelfiles.tokenizer import Tokenizer
from protocol.versions import ResolvedVersions, ServedVersions


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def versions(tiny_dir: Path) -> ResolvedVersions:
    tok = Tokenizer.from_dir(tiny_dir)
    revision = hashlib.sha256((tiny_dir / "model.safetensors").read_bytes()).hexdigest()
    return ResolvedVersions(TINY_MODEL_NAME, ServedVersions(
        revision, tok.sha256, tok.chat_template_sha256, engine_version()))


def test_header_value_uses_short_hashes(versions: ResolvedVersions) -> None:
    v = versions.versions
    assert engine_version().startswith("sluice-engine/")
    assert v.chat_template is not None
    assert versions.header_value() == (
        f"model=sluice-tiny; revision={v.revision[:12]}; "
        f"tokenizer={v.tokenizer[:12]}; chat_template={v.chat_template[:12]}; "
        f"engine={v.engine}"
    )
    no_template = ResolvedVersions("m", ServedVersions("main", "ab" * 32, None, "e/1"))
    assert no_template.header_value() == (
        f"model=m; revision=main; tokenizer={'ab' * 6}; chat_template=none; engine=e/1"
    )
    assert len(v.tokenizer) == 64  # fields keep full values


def test_fingerprint_is_stable_and_sensitive(versions: ResolvedVersions) -> None:
    fp = versions.fingerprint()
    assert fp.startswith("fp_") and len(fp) == 15
    v = versions.versions
    assert fp == ResolvedVersions(versions.model, dataclasses.replace(v)).fingerprint()
    changed = [dataclasses.replace(versions, model="x")] + [
        dataclasses.replace(versions, versions=dataclasses.replace(v, **{key: value}))
        for key, value in [("revision", "0" * 64), ("tokenizer", "1" * 64),
                           ("chat_template", None), ("engine", "sluice-engine/9")]
    ]
    assert len({fp, *(c.fingerprint() for c in changed)}) == 6
    assert set(versions.as_dict()) == {"model", "revision", "tokenizer", "chat_template", "engine"}


def test_prefix_cache_salt(versions: ResolvedVersions) -> None:
    root = prefix_cache_salt(versions, None)
    assert isinstance(root, bytes) and len(root) == 32
    assert root == prefix_cache_salt(versions, None) == prefix_cache_salt(versions, "")
    salts = {prefix_cache_salt(versions, s) for s in ["a", "b", "\x00", "\x01", "none"]}
    assert len(salts) == 5 and root not in salts
    v = versions.versions
    for key in ("revision", "tokenizer", "chat_template"):
        other = dataclasses.replace(versions, versions=dataclasses.replace(
            v, **{key: None if key == "chat_template" else "z"}))
        assert prefix_cache_salt(other, "a") != prefix_cache_salt(versions, "a")
    # The engine version and the display name do not change what a KV block contains.
    renamed = ResolvedVersions("alias", dataclasses.replace(v, engine="e/2"), "policy")
    assert prefix_cache_salt(renamed, "a") == prefix_cache_salt(versions, "a")


def test_prefix_cache_root_is_byte_identical_to_before() -> None:
    # computed by the ResolvedVersions.prefix_cache_salt this function replaced
    v = ResolvedVersions("m", ServedVersions("a" * 40, "b" * 64, None, "e"))
    assert prefix_cache_salt(v, "s").hex()[:16] == "32fa3d2af9cddd13"
