"""The `sluice` command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sluice.cli import main


def test_tiny_model_command_writes_the_same_bytes_as_the_cache(tmp_path: Path,
                                                                tiny_model_dir: Path) -> None:
    out = tmp_path / "tiny"
    assert main(["tiny-model", "--out", str(out)]) == 0
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    for name in names:
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_unknown_command_fails_with_usage() -> None:
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "no-such-command"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_backend_refuses_a_bad_thread_count(capsys) -> None:
    assert main(["backend", "--model", "tiny", "--threads", "0", "--no-api-key"]) == 2
    assert "num_threads must be >= 1" in capsys.readouterr().err


def test_backend_leaves_a_core_to_its_event_loop(monkeypatch, capsys) -> None:
    from backend.engine.errors import EngineError
    from backend.engine.process_transport import ProcessTransport
    from backend.engine.thread_transport import ThreadTransport
    from backend.faults import StepDelay

    seen = []

    def capture(kind):
        def from_config(config, *, step_hook=None):
            seen.append((kind, config.reserve_cores, config.num_threads, step_hook))
            raise EngineError("stop here")
        return staticmethod(from_config)

    monkeypatch.setattr(ThreadTransport, "from_config", capture("thread"))
    monkeypatch.setattr(ProcessTransport, "from_config", capture("process"))
    assert main(["backend", "--model", "tiny", "--no-api-key"]) == 2
    assert main(["backend", "--model", "tiny", "--threads", "2", "--engine-in-process",
                 "--fault-step-delay", "2.5", "--no-api-key"]) == 2
    # the fault is a step hook the composition root builds, never an engine setting
    assert seen == [("process", 1, None, None), ("thread", 1, 2, StepDelay(0.0025))]
    assert "stop here" in capsys.readouterr().err


def test_backend_refuses_a_bad_fault_step_delay(capsys) -> None:
    assert main(["backend", "--model", "tiny", "--fault-step-delay", "-1", "--no-api-key"]) == 2
    assert "--fault-step-delay must be in [0, 60000] ms" in capsys.readouterr().err


def test_up_applies_sluice_overrides_and_refuses_a_bad_one(monkeypatch) -> None:
    import argparse

    from gateway.cli import up_config
    from gateway.config import ModelEntry

    args = argparse.Namespace(host="127.0.0.1", port=8000, redis=None, tenants=None)
    entry = ModelEntry(name="m", upstream="http://127.0.0.1:8001")
    monkeypatch.setenv("SLUICE_QUEUE__RESERVE_SHARE", "0.25")
    monkeypatch.setenv("SLUICE_LISTEN__PORT", "9999")  # the flag names the port: it wins
    cfg = up_config(args, entry)
    assert cfg.queue.reserve_share == 0.25 and cfg.listen.port == 8000
    monkeypatch.setenv("SLUICE_QUEUE__RESERVE_SHARE", "2")
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "up", "--port", "1"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "queue.reserve_share" in proc.stderr
    assert "starting the bundled backend" not in proc.stdout  # refused before starting it


def test_tiny_model_small_size_has_the_small_shapes_and_the_same_tokenizer(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    import json

    from safetensors.numpy import load_file

    from modelfiles.tiny_model import SIZES

    out = tmp_path / "small"
    assert main(["tiny-model", "--size", "small", "--out", str(out)]) == 0
    shape = SIZES["small"]
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (
        shape.hidden, shape.layers, shape.hidden // shape.heads)
    weights = load_file(str(out / "model.safetensors"))
    assert weights["model.layers.0.mlp.up_proj.weight"].shape == (shape.intermediate,
                                                                  shape.hidden)
    assert len([k for k in weights if k.endswith("mlp.up_proj.weight")]) == shape.layers
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes()


def test_tiny_model_writes_a_draft_of_the_tiny_model(tmp_path: Path,
                                                     tiny_model_dir: Path) -> None:
    """`--size tiny-draft`: the tiny model's first layer, with its very embedding, final
    norm and head (a draft for --speculative draft:DIR)."""
    import json

    from safetensors.numpy import load_file

    out = tmp_path / "draft"
    assert main(["tiny-model", "--size", "tiny-draft", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    draft = load_file(str(out / "model.safetensors"))
    full = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(draft) == {k for k in full if not k.startswith("model.layers.")
                          or k.startswith("model.layers.0.")}
    for name, tensor in draft.items():
        assert (tensor == full[name]).all(), name
