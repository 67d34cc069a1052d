"""The published edition read as a reader reads it (issues 31 and 44): every page of `make site`'s
output opened in headless Chromium from the files themselves (file://, no server, no network), at
1280 px and on a phone (390 px):
- every image has loaded (plots, the Colab badge), no script failed, no formula is left as `$$`;
- the sidebar lists every chapter; every chapter shows outputs and says what produced them;
- no output is over 200 lines (a data dump);
- at 1280 px, prose is at most ~90 characters a line;
- at 390 px, nothing makes the page scroll sideways, and no output wraps its lines (a wide table
  scrolls in its own box);
- search, typed on the index page, finds a term of chapter 07 there and then;
- every link on a page that stays inside the edition points at a page that exists (anchors and the
  rest: course_lib.tooling.site check, over the same files).
Screenshots (the index, a chapter in light and dark, a phone page, the search) go to
$COURSE_BROWSER_SHOTS, or pytest's tmp_path. Opt-in, like the JupyterLab session test:
`COURSE_BROWSER_TESTS=1`, selenium importable, chromium and chromedriver on the PATH, and an edition
built (`make site`, or $COURSE_SITE):
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
MAX_OUTPUT_LINES = 200
MAX_LINE_CHARS = 90
SEARCH_TERM, SEARCH_FINDS = "persistent_workers", "notebooks/07_loading.html"


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

# What one page shows. Characters a line: the width of each paragraph of prose over the mean width of a
# character of its font (an English sample), as the reader's eye meets it.
JS_PAGE = """
const imgs = [...document.images];
const text = document.body.innerText;
const canvas = document.createElement('canvas').getContext('2d');
const sample = 'The loss scale doubles after 2000 steps without an inf; fp16 keeps 10 bits of mantissa.';
const perLine = [...document.querySelectorAll('.bd-article p, .bd-article li')]
  .filter(p => p.offsetParent !== null && p.innerText.length > 200 && !p.closest('.cell_output, pre, table'))
  .map(p => {
    const style = getComputedStyle(p);
    canvas.font = `${style.fontStyle} ${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
    const width = p.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    return Math.round(width / (canvas.measureText(sample).width / sample.length));
  });
const outputs = [...document.querySelectorAll('div.cell_output .output')];
return {
  images: imgs.length,
  broken: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 120)),
  rawMath: text.includes('$$'),
  outputs: outputs.length,
  longest_output: Math.max(0, ...outputs.map(o => o.innerText.split('\\n').length)),
  provenance: !!document.querySelector('.amp-provenance'),
  download: !!document.querySelector('a.amp-download'),
  sidebar_chapters: new Set([...document.querySelectorAll('.bd-sidebar-primary a[href]')]
    .map(a => a.href.split('#')[0]).filter(h => /notebooks\\/\\d\\d_[^/]*\\.html$/.test(h))).size,
  chars_per_line: Math.max(0, ...perLine),
  overflow: document.documentElement.scrollWidth - window.innerWidth,
  wrapped_outputs: [...document.querySelectorAll('div.cell_output pre')]
    .filter(p => getComputedStyle(p).whiteSpace !== 'pre').length,
  links: [...document.querySelectorAll('a[href]')].map(a => a.href).filter(h => h.startsWith('file:')),
};
"""
JS_WIDEST = """
return [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > window.innerWidth + 1)
  .slice(-3).map(e => e.tagName + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right));
"""
JS_SEARCH = """
const [term, done] = arguments;
const input = document.querySelector('#pst-search-dialog input[name=q]');
document.querySelector('.search-button-field, .search-button__button').click();
input.value = term;
input.dispatchEvent(new KeyboardEvent('keyup', {key: 'e', bubbles: true}));
const started = Date.now();
const poll = () => {
  const found = [...document.querySelectorAll('#search-results a[href]')].map(a => a.href);
  if (found.length || Date.now() - started > 20000) done(found); else setTimeout(poll, 200);
};
poll();
"""


def _driver(width: int, height: int, phone: bool = False):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROME
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
    ):
        options.add_argument(flag)
    if phone:  # a phone's viewport and pixel ratio, as Chrome's device mode has them
        options.add_experimental_option(
            "mobileEmulation", {"deviceMetrics": {"width": width, "height": height, "pixelRatio": 3}}
        )
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_script_timeout(30)
    return driver


def _shot(driver, url: str, path: Path, dark: bool = False) -> None:
    """A screenshot of `url` as a reader arriving there sees it: in a new tab, whose session storage is
    empty (the theme keeps the sidebar where the previous page left it, within a tab)."""
    back = driver.current_window_handle
    driver.switch_to.new_window("tab")
    try:
        driver.get(url)
        if dark:
            driver.execute_script("document.documentElement.dataset.theme = 'dark';")
        time.sleep(0.5)
        driver.save_screenshot(str(path))
    finally:
        driver.close()
        driver.switch_to.window(back)


def _pages() -> list[Path]:
    return sorted(p for p in SITE.rglob("*.html") if "_static" not in p.parts)


def test_every_page_reads_like_a_book_at_1280_px(tmp_path):
    shots = Path(os.environ.get("COURSE_BROWSER_SHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    driver = _driver(1280, 900)
    pages, problems, widest = _pages(), [], 0
    try:
        for page in pages:
            rel = page.relative_to(SITE)
            driver.get(page.as_uri())
            seen = driver.execute_script(JS_PAGE)
            errors = [e["message"][:160] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            problems += [f"{rel}: image not loaded: {src}" for src in seen["broken"]]
            problems += [f"{rel}: console error: {msg}" for msg in errors]
            if seen["rawMath"] and not rel.name.endswith(".py.html"):  # a source file may say `$$` itself
                problems.append(f"{rel}: a formula left untypeset ($$ in the text)")
            for link in seen["links"]:
                target = Path(link.split("#")[0].split("?")[0].removeprefix("file://"))
                if not target.exists():
                    problems.append(f"{rel}: link to a missing page: {link}")
            if rel.name not in ("search.html", "genindex.html") and seen["sidebar_chapters"] < 12:
                problems.append(f"{rel}: the sidebar lists {seen['sidebar_chapters']} chapters, not every one")
            if seen["longest_output"] > MAX_OUTPUT_LINES:
                problems.append(f"{rel}: an output of {seen['longest_output']} lines (a data dump)")
            if seen["chars_per_line"] > MAX_LINE_CHARS:
                problems.append(f"{rel}: prose of {seen['chars_per_line']} characters a line")
            widest = max(widest, seen["chars_per_line"])
            if str(rel).startswith("notebooks"):
                for what in ("outputs", "provenance", "download"):
                    if not seen[what]:
                        problems.append(f"{rel}: no {what}")
            if rel.as_posix() in ("index.html", "notebooks/07_loading.html", "notebooks/01_formats.html"):
                _shot(driver, page.as_uri(), shots / f"1280-{rel.as_posix().replace('/', '-')}.png")
        chapter = (SITE / "notebooks" / "07_loading.html").as_uri()
        _shot(driver, chapter, shots / "1280-dark-notebooks-07_loading.html.png", dark=True)
        driver.get((SITE / "index.html").as_uri())
        found = driver.execute_async_script(JS_SEARCH, SEARCH_TERM)
        driver.save_screenshot(str(shots / "1280-search.png"))
    finally:
        driver.quit()
    assert len(pages) > 40, f"only {len(pages)} pages in {SITE}"
    assert any(link.split("#")[0].endswith(SEARCH_FINDS) for link in found), f"search for {SEARCH_TERM}: {found}"
    assert not problems, "\n".join(problems)
    assert widest > 40, f"no paragraph of prose measured ({widest} characters a line at most)"


def test_no_page_scrolls_sideways_on_a_phone(tmp_path):
    shots = Path(os.environ.get("COURSE_BROWSER_SHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    driver = _driver(390, 844, phone=True)
    problems = []
    try:
        for page in _pages():
            rel = page.relative_to(SITE)
            driver.get(page.as_uri())
            seen = driver.execute_script(JS_PAGE)
            if seen["overflow"] > 1:
                widest = driver.execute_script(JS_WIDEST)
                problems.append(f"{rel}: {seen['overflow']} px wider than the phone: {widest}")
            if seen["wrapped_outputs"]:  # a printed table keeps its lines and scrolls in its own box
                problems.append(f"{rel}: {seen['wrapped_outputs']} outputs wrap their lines on a phone")
            if rel.as_posix() in ("index.html", "notebooks/10_memory.html", "notebooks/02_autocast.html"):
                _shot(driver, page.as_uri(), shots / f"390-{rel.as_posix().replace('/', '-')}.png")
    finally:
        driver.quit()
    assert not problems, "\n".join(problems)
