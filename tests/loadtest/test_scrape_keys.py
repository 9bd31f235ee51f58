"""The scraper sends a bundled backend's API key to that backend's /metrics and nowhere else."""

from __future__ import annotations

from loadtest.scrape import Scraper


def test_a_key_goes_to_its_own_url_only() -> None:
    s = Scraper(["http://gw:8000", "http://backend:8001/"], keys={"http://backend:8001/": "k"})
    assert s.urls == ["http://gw:8000/metrics", "http://backend:8001/metrics"]
    assert s.headers == {"http://backend:8001/metrics": {"authorization": "Bearer k"}}
    assert Scraper(["http://gw:8000"]).headers == {}
