"""Reading the JSON files of a checkpoint (config.json, tokenizer_config.json, …)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ModelLoadError


def read_json_object(path: Path) -> dict[str, Any]:
    """A model file that must hold a JSON object (config.json, tokenizer_config.json …);
    ``ModelLoadError`` naming the file otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path.name}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name} must hold a JSON object")
    return data
