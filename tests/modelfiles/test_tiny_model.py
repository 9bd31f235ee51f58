"""The deterministic tiny checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub read it
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest

from modelfiles import tiny_model
from modelfiles.revision import model_revision
from modelfiles.tiny_model import ensure_tiny_model, write_tiny_model
from modelfiles.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPECTED_FILES = {
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json", "chat_template.jinja",
}
MESSAGES = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Will it rain in Zürich? 🌧️"},
    {"role": "assistant", "content": "Probably, 70%."},
    {"role": "user", "content": "谢谢"},
]


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


def test_layout_and_config(tiny_dir: Path) -> None:
    assert {p.name for p in tiny_dir.iterdir()} == EXPECTED_FILES
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] >= 1024
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (
        64, 4, 2
    )
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "float32"
    tok = Tokenizer.from_dir(tiny_dir)
    assert config["bos_token_id"] == tok.bos_token_id
    assert tuple(config["eos_token_id"]) == tok.eos_token_ids
    # JSON is canonical: sorted keys, so the bytes do not depend on dict insertion order.
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        text = (tiny_dir / name).read_text()
        assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"


def test_two_builds_are_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    # The second build runs in a fresh process with a different hash seed and thread count,
    # which is what would expose hash-order or thread-order dependence in BPE training.
    other = tmp_path / "other"
    code = "import sys; from pathlib import Path; from modelfiles.tiny_model import " \
           "write_tiny_model; write_tiny_model(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code, str(other)], check=True, env=env, cwd=REPO_ROOT)
    assert _digests(other) == _digests(tiny_dir)
    assert set(_digests(other)) == EXPECTED_FILES


def test_transformers_loads_it_and_tokenizers_agree(tiny_dir: Path, hf_model: Any) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tiny_dir)
    ours = Tokenizer.from_dir(tiny_dir)
    assert hf_model.config.vocab_size == 1024
    texts = ["plain text", "naïve café 🙂 中文 日本語", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf_tok.encode(text, add_special_tokens=special)
            assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    for gen in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == (
            hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
        )


def test_greedy_continuation_is_varied_and_decisive(tiny_dir: Path, hf_model: Any) -> None:
    import torch

    tok = Tokenizer.from_dir(tiny_dir)
    prompt = tok.encode(tok.apply_chat_template(MESSAGES[:2]), add_special_tokens=False)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                pad_token_id=1)
        generated = out[0, len(prompt):].tolist()
        logits = hf_model(out).logits[0, len(prompt) - 1 : -1]
    assert len(generated) == 8 and len(set(generated)) > 2, generated
    top2 = logits.topk(2, dim=-1).values
    # Argmax margins far above float32 noise: engine-vs-reference greedy tests stay stable.
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-2


def test_ensure_tiny_model_is_idempotent(tmp_path: Path, tiny_dir: Path) -> None:
    first = ensure_tiny_model(tmp_path)
    assert first.parent == tmp_path and first.name == f"tiny-{tiny_model.generator_hash()}"
    assert _digests(first) == _digests(tiny_dir)
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert ensure_tiny_model(tmp_path) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == mtimes  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dirs left behind


def test_ensure_tiny_model_concurrent_callers(tmp_path: Path, tiny_dir: Path) -> None:
    barrier = threading.Barrier(4)

    def build(_: int) -> Path:
        barrier.wait()
        return ensure_tiny_model(tmp_path)

    with ThreadPoolExecutor(4) as pool:
        paths = set(pool.map(build, range(4)))
    assert len(paths) == 1
    (path,) = paths
    assert _digests(path) == _digests(tiny_dir)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_ensure_tiny_model_loses_a_race_cleanly(tmp_path: Path, tiny_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / f"tiny-{tiny_model.generator_hash()}"
    real_write = tiny_model.write_tiny_model

    def write_then_lose(out_dir: Path) -> Path:
        real_write(out_dir)
        real_write(target)  # another process finishes first, just before our rename
        return out_dir

    monkeypatch.setattr(tiny_model, "write_tiny_model", write_then_lose)
    assert ensure_tiny_model(tmp_path) == target
    assert _digests(target) == _digests(tiny_dir)
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_ensure_tiny_model_failure_leaves_nothing(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out_dir: Path) -> Path:
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(tiny_model, "write_tiny_model", broken)
    with pytest.raises(OSError, match="disk full"):
        ensure_tiny_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_published_bytes_do_not_change(tiny_dir: Path) -> None:
    # The revision, tokenizer and template hashes every `--model tiny` answer reports (and the
    # prefix cache salts with). A change here must bump GENERATOR_VERSION.
    tok = Tokenizer.from_dir(tiny_dir)
    assert model_revision(tiny_dir) == (
        "776330485d788ac694d45351865b29de8f28929d002da341d38dce4abb8ddcbb")
    assert tok.sha256 == "b59d0043991497a4dabfbf99b90a86c5871b096ccf27a657bb4d30140cc501c2"
    assert tok.chat_template_sha256 == (
        "18ba8d31f2b25b5f1c881dfa374a99f77a6fadd8f072d43f6a8a9c5aad719074")
    assert tiny_model.generator_hash() == "74dba1194159"
