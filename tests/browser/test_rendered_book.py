"""Open the built book in headless Chromium, offline, and check what a reader would see.

Needs ``_build/html`` (``make book`` or ``make book-check``), Debian's ``chromium`` and
``chromium-driver``. Skipped when any is missing, unless ``REQUIRE_BROWSER=1`` (set by CI), which
turns the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHAPTERS = [f"notebooks/{name}.html" for name in NOTEBOOKS]
# Every page of the book has math; every chapter has figures.
PAGES_WITH_MATH = ["book/intro.html", "book/notation.html", *CHAPTERS]


def missing(reason: str) -> None:
    if os.environ.get("REQUIRE_BROWSER") == "1":
        pytest.fail(f"REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    if not (HTML / "book" / "intro.html").is_file():
        missing(f"the book is not built at {HTML}")
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver_path:
        missing("chromium or chromedriver is missing: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-quic",
        # No network: every http(s) request goes to a proxy that does not exist and fails.
        "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
        "--window-size=1280,900",
    ]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def open_page(driver, page: str) -> None:
    path = HTML / page
    assert path.is_file(), f"{page} was not built"
    driver.get(path.as_uri())


TYPESET = """
const done = arguments[arguments.length - 1];
if (!window.MathJax || !MathJax.startup) { done({error: "MathJax did not load"}); return; }
MathJax.startup.promise.then(() => {
  const math = [...document.querySelectorAll(".math")];
  done({
    math: math.length,
    typeset: math.filter(el => el.querySelector("mjx-container")).length,
    errors: document.querySelectorAll("mjx-merror").length,
  });
}).catch(e => done({error: String(e)}));
"""

IMAGES = """
const done = arguments[arguments.length - 1];
const imgs = [...document.images];
Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })))
  .then(() => done(imgs.map(i => ({src: i.src, width: i.naturalWidth}))));
"""


@pytest.mark.parametrize("page", PAGES_WITH_MATH)
def test_math_is_typeset_offline(browser, page):
    open_page(browser, page)
    result = browser.execute_async_script(TYPESET)
    assert "error" not in result, result.get("error")
    assert result["math"] > 0, f"{page} has no math to check"
    assert result["typeset"] == result["math"], f"{page}: untypeset math: {result}"
    assert result["errors"] == 0, f"{page}: {result['errors']} TeX errors"


@pytest.mark.parametrize("page,at_least", [("book/intro.html", 1)] + [(c, 1) for c in CHAPTERS])
def test_figures_load_offline(browser, page, at_least):
    open_page(browser, page)
    images = browser.execute_async_script(IMAGES)
    figures = [i for i in images if "_images/" in i["src"]]
    assert len(figures) >= at_least, f"{page}: expected {at_least}+ figures, found {images}"
    broken = [i["src"] for i in images if i["width"] == 0]
    assert not broken, f"{page}: images that did not load: {broken}"


def test_every_resource_is_local(browser):
    for page in PAGES_WITH_MATH:
        open_page(browser, page)
        browser.execute_async_script(TYPESET)
        urls = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        remote = [u for u in urls if not u.startswith("file:")]
        assert not remote, f"{page} asked the network for {remote}"
