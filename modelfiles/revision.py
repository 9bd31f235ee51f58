"""A checkpoint's weight files, and the revision hash that names them.

Accepted layouts: ``model.safetensors``, or ``model.safetensors.index.json`` naming shards.
The revision is content-addressed: the same files give the same revision wherever they lie,
and one changed bit of config or weights gives another. Every response reports it, and the
prefix cache salts its hash chain with it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import MissingFileError, ModelLoadError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_CHUNK = 1 << 20


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a directory; MissingFileError if there is none."""
    root = Path(path)
    if not root.is_dir():
        raise MissingFileError(f"model directory not found: {root}")
    return root


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files holding the weights (every shard the index names)."""
    root = checkpoint_dir(path)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc}") from exc
        shards = [root / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise MissingFileError(f"shard {shard.name} named in {INDEX_FILE} is missing")
        return shards
    single = root / SINGLE_FILE
    if single.is_file():
        return [single]
    raise MissingFileError(f"no weights in {root}: looked for {SINGLE_FILE} and {INDEX_FILE}")


def model_revision(path: str | Path) -> str:
    """sha256 over config.json and the weight files, each prefixed by its name."""
    root = checkpoint_dir(path)
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise MissingFileError(f"{CONFIG_FILE} not found in {root}")
    digest = hashlib.sha256()
    for file in [config_path, *sorted(weight_files(root), key=lambda p: p.name)]:
        digest.update(file.name.encode() + b"\0")
        digest.update(str(file.stat().st_size).encode() + b"\0")
        with file.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
