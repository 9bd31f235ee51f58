"""Image and audio parts cost what the model declares, not the bytes of their URL."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image

from gateway.contract import parse
from gateway.errors import BadRequest
from gateway.media import ImageRule, MediaCosts, image_size
from gateway.resolve import Prepared

from .stage_kit import config, gateway, tenant

OPENAI = ImageRule(fixed=85, per_tile=170, tile=512)  # OpenAI's published rule


def data_url(w: int, h: int, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, fmt)
    mime = "jpeg" if fmt == "JPEG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(("size", "low", "tokens"), [
    ((1024, 1024), False, 765),  # OpenAI's worked examples
    ((2048, 4096), False, 1105),
    ((4096, 8192), False, 1105),
    ((512, 512), False, 255),
    ((100, 3000), False, 85 + 170 * 4),  # fit 2048 first: 68 × 2048, 4 tiles of 512
    ((1024, 1024), True, 85),
    (None, False, 85 + 170 * 8),  # size unknown (a URL): the most tiles any image takes
])
def test_the_tiled_rule(size: tuple[int, int] | None, low: bool, tokens: int) -> None:
    assert OPENAI.cost(size, low) == tokens


def test_a_flat_rule_ignores_the_size() -> None:
    assert ImageRule(fixed=576).cost((4000, 3000), low=False) == 576
    assert ImageRule(fixed=576).cost(None, low=False) == 576


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_an_inline_images_size_is_read_from_its_header(fmt: str) -> None:
    assert image_size(data_url(640, 480, fmt)) == (640, 480)


@pytest.mark.parametrize("url", [
    "https://example.com/cat.png",  # never fetched
    "data:image/png;base64,bm90IGFuIGltYWdl",  # "not an image"
    "data:image/png;base64,!!!",
    "data:image/png,rawbytes",
    "data:",
])
def test_what_cannot_be_read_is_charged_the_worst_case(url: str) -> None:
    assert image_size(url) is None


def image_part(url: str, detail: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"url": url}
    if detail:
        spec["detail"] = detail
    return {"type": "image_url", "image_url": spec}


def test_split_takes_the_media_out_and_prices_them() -> None:
    costs = MediaCosts(OPENAI, audio=50)
    plain = [{"role": "user", "content": "hi"}]
    assert costs.split(plain) == (plain, 0) and costs.split(plain)[0] is plain
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            image_part(data_url(1024, 1024)),
            image_part("https://example.com/x.png", detail="low"),
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        ]},
    ]
    text, cost = costs.split(messages)
    assert cost == 765 + 85 + 50
    assert text == [messages[0], {"role": "user",
                                  "content": [{"type": "text", "text": "what is this?"}]}]
    assert len(messages[1]["content"]) == 4  # the request itself is not changed


@pytest.mark.parametrize(("costs", "part", "what"), [
    (MediaCosts(), image_part("https://example.com/x.png"), "takes no images"),
    (MediaCosts(OPENAI), {"type": "input_audio", "input_audio": {}}, "takes no audio"),
    (MediaCosts(OPENAI), {"type": "image_url", "image_url": {}}, "must be a URL"),
])
def test_a_model_that_takes_no_such_part_refuses_it_naming_it(
        costs: MediaCosts, part: dict[str, Any], what: str) -> None:
    messages = [{"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "text", "text": "b"}, part]}]
    with pytest.raises(BadRequest) as refused:
        costs.split(messages)
    assert refused.value.param == "messages[1].content[1]" and what in refused.value.message


async def prepared(body: dict[str, Any], **entry: Any) -> Prepared:
    r = gateway(config(**entry), {}).resolver
    who = tenant()
    req = parse("chat", body)
    return await r.prepare("chat", req, body, await r.target(req, who), who, "rid", None)


async def test_a_photo_costs_its_declared_tokens_not_its_bytes() -> None:
    photo = data_url(1024, 1024, "JPEG")
    text = {"type": "text", "text": "describe it"}
    with_photo = {"model": "m", "max_tokens": 10,
                  "messages": [{"role": "user", "content": [text, image_part(photo)]}]}
    without = {"model": "m", "max_tokens": 10,
               "messages": [{"role": "user", "content": [text]}]}
    rule = {"fixed": 85, "per_tile": 170, "tile": 512}
    p = await prepared(with_photo, image_tokens=rule)
    base = await prepared(without, image_tokens=rule)
    assert p.prompt_tokens == base.prompt_tokens + 765  # not len(photo) ~ thousands
    assert p.worst_case == p.prompt_tokens + 10
    assert p.body["messages"][0]["content"][1]["image_url"]["url"] == photo  # forwarded
    with pytest.raises(BadRequest) as refused:
        await prepared(with_photo)  # this model declares no image_tokens
    assert refused.value.param == "messages[0].content[1]"
