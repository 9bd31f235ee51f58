"""What image and audio parts of a chat request cost, as the model will charge them.

A model declares it in gateway.yaml (``ModelEntry.image_tokens`` / ``audio_tokens``); a
model that declares nothing takes no images (or no audio), and a request that sends one
gets a 400 naming the part. The text of the request is counted without its media parts
(before, an image counted as the bytes of its URL: 157 "tokens" for a photo), and each part
adds its declared cost:

- ``image_tokens: 765``: every image costs that (flat);
- ``image_tokens: {fixed: 85, per_tile: 170, tile: 512}``: OpenAI's tiled rule. With
  ``detail: "low"`` an image costs ``fixed``; otherwise it is scaled to fit ``fit`` ×
  ``fit`` (2048), then down so its short side is at most ``short_side`` (768), and costs
  ``fixed + per_tile × tiles`` (``tile``-pixel tiles). The size of an image sent inline (a
  ``data:`` URL) is read from its header (Pillow reads the header only, nothing is
  decoded); an image by URL is not fetched, so it is charged the most tiles any image can
  take (8 with the defaults): the worst case, settled at what the upstream reports;
- ``audio_tokens: N``: every audio part (``input_audio``) costs N, a bound the operator
  declares (per-second pricing needs the clip's length, which the gateway does not decode).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from typing import Any

from .errors import BadRequest

IMAGE_PARTS = frozenset({"image_url"})
AUDIO_PARTS = frozenset({"input_audio", "audio_url"})


@dataclass(slots=True, frozen=True)
class ImageRule:
    """An image's cost: flat (``per_tile`` 0) or tiled (see the module)."""

    fixed: int
    per_tile: int = 0
    tile: int = 512
    fit: int = 2048
    short_side: int = 768

    def cost(self, size: tuple[int, int] | None, low: bool) -> int:
        if low or not self.per_tile:
            return self.fixed
        return self.fixed + self.per_tile * self.tiles(size)

    def tiles(self, size: tuple[int, int] | None) -> int:
        """Tiles of an image of ``size`` (w, h) once scaled; None: the most any image
        can take."""
        if size is None:
            return self.max_tiles()
        if size[0] <= 0 or size[1] <= 0:
            return self.max_tiles()
        scale = min(1.0, self.fit / max(size))
        w, h = size[0] * scale, size[1] * scale
        scale = min(1.0, self.short_side / min(w, h))
        return math.ceil(w * scale / self.tile) * math.ceil(h * scale / self.tile)

    def max_tiles(self) -> int:
        """The most tiles after scaling: the short side at most ``short_side`` and the long
        side at most ``fit`` (both reachable by one image)."""
        short = min(self.short_side, self.fit)
        return math.ceil(short / self.tile) * math.ceil(self.fit / self.tile)


@dataclass(slots=True, frozen=True)
class MediaCosts:
    """A model's media prices; None: it takes none of that kind."""

    image: ImageRule | None = None
    audio: int | None = None

    def split(self, messages: list[Any]) -> tuple[list[Any], int]:
        """``messages`` without their media parts (what the text is counted from) and
        what those parts cost; a 400 naming the part when the model does not take it.
        ``messages`` itself when it has no media parts (nothing is copied)."""
        if not any(_has_media(m) for m in messages):
            return messages, 0
        out: list[Any] = []
        total = 0
        for i, message in enumerate(messages):
            if not _has_media(message):
                out.append(message)
                continue
            kept = []
            for j, part in enumerate(message["content"]):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in IMAGE_PARTS:
                    total += self._image(part, f"messages[{i}].content[{j}]")
                elif kind in AUDIO_PARTS:
                    total += self._audio(f"messages[{i}].content[{j}]")
                else:
                    kept.append(part)
            out.append({**message, "content": kept})
        return out, total

    def _image(self, part: dict[str, Any], where: str) -> int:
        rule = self.image
        if rule is None:
            raise BadRequest(f"{where} is an image, and this model takes no images "
                             "(its image_tokens are not declared in gateway.yaml)", where,
                             code="unsupported_content")
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        detail = spec.get("detail") if isinstance(spec, dict) else None
        if not isinstance(url, str) or not url:
            raise BadRequest(f"{where}.image_url.url must be a URL or a data: URL", where,
                             code="invalid_value")
        size = image_size(url) if rule.per_tile and detail != "low" else None
        return rule.cost(size, low=detail == "low")

    def _audio(self, where: str) -> int:
        if self.audio is None:
            raise BadRequest(f"{where} is audio, and this model takes no audio (its "
                             "audio_tokens are not declared in gateway.yaml)", where,
                             code="unsupported_content")
        return self.audio


def _has_media(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    if type(content) is not list:
        return False
    for part in content:
        if isinstance(part, dict) and (part.get("type") in IMAGE_PARTS
                                       or part.get("type") in AUDIO_PARTS):
            return True
    return False


def image_size(url: str) -> tuple[int, int] | None:
    """(width, height) of an inline image (``data:image/...;base64,``) from its header;
    None for a URL (not fetched) or what cannot be read (charged the worst case)."""
    if not url.startswith("data:"):
        return None
    head, sep, data = url.partition(",")
    if not sep or not head.endswith(";base64"):
        return None
    try:
        raw = base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError):
        return None
    from PIL import Image, UnidentifiedImageError  # only when an inline image is priced

    try:
        with Image.open(io.BytesIO(raw)) as img:  # reads the header; decodes nothing
            w, h = img.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return None
    return int(w), int(h)
