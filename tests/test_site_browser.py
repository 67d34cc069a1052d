"""The published edition read as a reader reads it (issue 31): every page of `make site`'s output
opened in headless Chromium from the files themselves (file://, no server, no network):
- every image on every page has loaded (plots, the Colab badge), and no script failed;
- the formulas were typeset by the edition's own MathJax (no raw `$$` left on a page);
- every notebook page shows outputs, and says what produced them;
- every link on a page that stays inside the edition points at a page that exists (and, with an
  anchor, at an element that exists: course_lib.tooling.site.check does that part, over the
  same files).
Opt-in, like the JupyterLab session test: `COURSE_BROWSER_TESTS=1`, selenium importable, chromium
and chromedriver on the PATH, and an edition built (`make site`, or $COURSE_SITE). Screenshots go
to $COURSE_BROWSER_SHOTS, or pytest's tmp_path:
    make site && COURSE_BROWSER_TESTS=1 .venv/bin/python -m pytest tests/test_site_browser.py
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("COURSE_SITE") or ROOT / "build" / "site")
CHROME = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")


def _why_skip() -> str | None:
    if os.environ.get("COURSE_BROWSER_TESTS") != "1":
        return "a browser over every page of the edition: set COURSE_BROWSER_TESTS=1 to run it"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    if not CHROME or not DRIVER:
        return "chromium and chromedriver are not on the PATH (apt-get install chromium chromium-driver)"
    if not (SITE / "index.html").exists():
        return f"no edition at {SITE}: run `make site` first"
    return None


pytestmark = pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or "")

# What one page shows, read in the page after MathJax has finished.
JS_PAGE = """
const imgs = [...document.images];
const text = document.body.innerText;
return {
  images: imgs.length,
  broken: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 120)),
  rawMath: text.includes('$$'),
  typeset: document.querySelectorAll('.MathJax, .MathJax_Display, .MathJax_CHTML, mjx-container').length,
  outputs: document.querySelectorAll('.jp-OutputArea-output').length,
  provenance: !!document.querySelector('.amp-provenance'),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href).filter(h => h.startsWith('file:')),
};
"""
JS_MATH_DONE = """
if (!window.MathJax || !MathJax.Hub) return true;
return MathJax.Hub.queue.pending === 0 && MathJax.Hub.queue.running === 0;
"""


def test_every_page_of_the_edition_loads_its_images_formulas_and_outputs(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    shots = Path(os.environ.get("COURSE_BROWSER_SHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROME
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1300,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    pages = sorted(p for p in SITE.rglob("*.html") if "_static" not in p.parts)
    problems: list[str] = []
    try:
        for page in pages:
            rel = page.relative_to(SITE)
            driver.get(page.as_uri())
            deadline = time.monotonic() + 30
            while not driver.execute_script(JS_MATH_DONE) and time.monotonic() < deadline:
                time.sleep(0.2)
            seen = driver.execute_script(JS_PAGE)
            errors = [e["message"][:160] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            problems += [f"{rel}: image not loaded: {src}" for src in seen["broken"]]
            problems += [f"{rel}: console error: {msg}" for msg in errors]
            if seen["rawMath"] and not rel.name.endswith(".py.html"):  # a source file may say `$$` itself
                problems.append(f"{rel}: a formula left untypeset ($$ in the text)")
            for link in seen["links"]:
                target = Path(link.split("#")[0].removeprefix("file://"))
                if not target.exists():
                    problems.append(f"{rel}: link to a missing page: {link}")
            if str(rel).startswith(("notebooks", "exercises")):
                if not seen["outputs"]:
                    problems.append(f"{rel}: no outputs shown")
                if not seen["provenance"]:
                    problems.append(f"{rel}: does not say what produced it")
            if rel.name in ("index.html", "11_speed.html", "01_formats.html", "04_accumulation.html"):
                driver.save_screenshot(str(shots / f"{rel.parent.name}-{rel.stem}.png"))
    finally:
        driver.quit()
    assert len(pages) > 20, f"only {len(pages)} pages in {SITE}"
    assert not problems, "\n".join(problems)
