"""report.html as a browser shows it: headless Chromium loads the page written from a
hand-built run and must find the summary card's figures, every table and every plot
decoded, and paint a page that is not blank.

Skipped without ``chromium`` on PATH, unless SLUICE_REQUIRE_CHROMIUM=1 (CI), where a
missing browser fails instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from loadtest.report_content import PLOTS, num
from loadtest.stats import LATENCY_KEYS
from tests.loadtest.test_report import write_report

CHROMIUM_TIMEOUT_S = 120  # a cold start on a busy 2-core machine takes seconds, not minutes
# Run once the page has loaded: each <img> says whether (and how large) it was decoded.
PROBE = ("<script>window.addEventListener('load', () => { for (const img of document.images)"
         " img.setAttribute('data-decoded', img.complete && img.naturalWidth > 0 ? "
         "img.naturalWidth + 'x' + img.naturalHeight : 'no'); });</script>")


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("SLUICE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is not installed and SLUICE_REQUIRE_CHROMIUM=1")
        pytest.skip("chromium is not installed")
    return path


def headless(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """One headless Chromium run (root in a container needs --no-sandbox), its own
    throwaway profile, bounded in time."""
    done = subprocess.run(
        [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
         "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_report_html_in_headless_chromium(chromium: str, tmp_path: Path) -> None:
    from PIL import Image

    out = tmp_path / "report"
    report, details = write_report(out, ("chat", "batch"))
    page = (out / "report.html").read_text()
    probe = out / "probe.html"  # the page plus the probe script, next to it
    probe.write_text(page.replace("</body>", PROBE + "</body>"))

    dom = headless(chromium, tmp_path / "profile-dom", "--dump-dom", probe.as_uri()).stdout
    # the summary card, with its figures as formatted on the page
    card = dom.split('<div class="card">', 1)[1]
    for value, label in ((f"{num(report['goodput_rps'])} rps", "goodput"),
                         ("60.0%", "joint SLO attainment"),
                         (f"{num(details['overall']['ttft_ms']['p99'])} ms", "p99 TTFT"),
                         ("$0.000833", "cost per success"),
                         ("open loop (constant) at 2 rps", "mode")):
        assert (f'<div class="value">{value}</div><div class="label">{label}</div>'
                in card), (value, label)
    # every table: outcomes, per class, six latency tables, per SLO, tenants, priorities
    assert dom.count("<table>") == 3 + len(LATENCY_KEYS) + 2
    assert dom.count('<tr class="total">') == 3 + len(LATENCY_KEYS)
    for h3 in ("TTFT, time to first token (ms)",
               "ICL, inter-chunk latency: one value per streamed event (ms)"):
        assert f"<h3>{h3}</h3>" in dom
    # every plot inlined and decoded at the size of its PNG
    decoded = dict(re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,[^"]+" '
                              r'data-decoded="([^"]+)"', dom))
    assert set(decoded) == set(PLOTS), decoded
    for name in PLOTS:
        with Image.open(out / name) as png:
            assert decoded[name] == f"{png.width}x{png.height}", name

    shot = tmp_path / "shot.png"
    headless(chromium, tmp_path / "profile-shot", f"--screenshot={shot}",
             "--window-size=1280,4000", (out / "report.html").as_uri())
    with Image.open(shot) as im:
        rgb = im.convert("RGB")
        assert rgb.size == (1280, 4000)
        colours = rgb.getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 64  # text, tables, plots: not blank
        # the top (title and summary card) is painted too, not only the plots further down
        top = rgb.crop((0, 0, 1280, 300)).getcolors(maxcolors=1 << 20)
        assert top is not None and len(top) > 2
