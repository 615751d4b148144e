"""Open the built book in headless Chromium, offline, and check what a reader would see.

Needs ``_build/html`` (``make book`` or ``make book-check``), Debian's ``chromium`` and
``chromium-driver``. Skipped when any is missing, unless ``REQUIRE_BROWSER=1`` (set by CI), which
turns the skip into a failure.

Besides "it loads offline", the tests check what a reader sees in a 1280 px wide window: no raw
TeX, Markdown tables or undecodable bytes left in the text, source captions that name the
library's own files, figures shown at a legible scale, and code, printed output, display math
and tables that fit the column without a sideways scrollbar. ``KNOWN`` lists the pages that still
fail a check, each as a strict xfail: fixing the page flips the test to XPASS, which fails the
run until the entry is removed.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHAPTERS = [f"notebooks/{name}.html" for name in NOTEBOOKS]
# Every page of the book has math; every chapter has figures.
PAGES_WITH_MATH = ["book/intro.html", "book/notation.html", *CHAPTERS]
PAGES = [*PAGES_WITH_MATH, "book/references.html"]

# Pages that still fail a check, and why. Each is a strict xfail (see the module docstring).
KNOWN: dict[tuple[str, str], str] = {}


def pages(check: str, names: list[str]) -> list:
    """``names`` as parameters of ``check``, with the known failures marked strict xfail."""
    return [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=KNOWN[check, p]))
        if (check, p) in KNOWN
        else p
        for p in names
    ]


def missing(reason: str) -> None:
    if os.environ.get("REQUIRE_BROWSER") == "1":
        pytest.fail(f"REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


def new_driver():
    """Headless Chromium at 1280 x 900 with the network cut off."""
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
    driver.set_script_timeout(SCRIPT_TIMEOUT_S)
    driver.set_page_load_timeout(SCRIPT_TIMEOUT_S)
    return driver


# A page reads in 1-3 s; the scripts below give MathJax at most 20 s to start and 20 s to typeset.
SCRIPT_TIMEOUT_S = 60


class Browser:
    """Opens a page of the built book and runs a script on it.

    Now and then this headless Chromium stalls on a page that reads in two seconds the next time
    (no article within 20 s, or no script result within ``SCRIPT_TIMEOUT_S``; about one page in
    fifty on a loaded 2-core machine). Such a page is read once more in a fresh browser, with a
    warning; a page that stalls twice fails. A script that reports ``{"error": ...}`` fails the
    test at once.
    """

    def __init__(self):
        self.driver = None

    def read(self, page: str, script: str, *, wait: bool = True):
        """``script``'s result on ``page``: asynchronous (it calls its callback) if ``wait``."""
        from selenium.common.exceptions import TimeoutException

        path = HTML / page
        assert path.is_file(), f"{page} was not built"
        for attempt in (1, 2):
            if self.driver is None:
                self.driver = new_driver()
            try:
                self.driver.get(path.as_uri())
                self.wait_for_article(path.as_uri())
                run = self.driver.execute_async_script if wait else self.driver.execute_script
                result = run(script)
                break
            except TimeoutException as stall:
                self.close()
                if attempt == 2:
                    raise
                warnings.warn(f"{page} stalled ({stall.msg}); read again", stacklevel=2)
        if isinstance(result, dict) and "error" in result:
            pytest.fail(f"{page}: {result['error']}")
        return result

    def wait_for_article(self, uri: str) -> None:
        """Wait until ``uri`` has loaded and shows its article; a stall if not within 20 s.

        ``driver.get`` can return before the page's document exists (seen on this headless
        Chromium about once in a hundred loads): a script run then finds no article.
        """
        from selenium.common.exceptions import TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait

        def ready(driver) -> bool:
            return driver.execute_script(
                "return location.href === arguments[0] && document.readyState === 'complete'"
                " && document.querySelector('article.bd-article') !== null",
                uri,
            )

        try:
            WebDriverWait(self.driver, 20, poll_frequency=0.1).until(ready)
        except TimeoutException as stalled:
            raise TimeoutException(f"{uri} showed no article within 20 s") from stalled

    def close(self) -> None:
        if self.driver is not None:
            self.driver.quit()
            self.driver = None


# One browser for the module (starting Chromium costs about as much as reading a page); a page
# that stalls is read again in a fresh one (Browser.read), so a stall cannot slow later tests.
@pytest.fixture(scope="module")
def browser():
    if not (HTML / "book" / "intro.html").is_file():
        missing(f"the book is not built at {HTML}")
    reader = Browser()
    yield reader
    reader.close()


# MathJax may still be starting when the page's load event fires: wait up to 20 s for it
TYPESET = """
const done = arguments[arguments.length - 1];
const started = Date.now();
(function ready() {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { typeset(); return; }
  if (Date.now() - started > 20000) { done({error: "MathJax did not load in 20 s"}); return; }
  setTimeout(ready, 100);
})();
function typeset() { MathJax.startup.promise.then(() => {
  const math = [...document.querySelectorAll(".math")];
  done({
    math: math.length,
    typeset: math.filter(el => el.querySelector("mjx-container")).length,
    errors: document.querySelectorAll("mjx-merror").length,
  });
}).catch(e => done({error: String(e)})); }
"""

# images below the fold may be lazy: made eager, every one loads (or fails) in a headless window
IMAGES = """
const done = arguments[arguments.length - 1];
const imgs = [...document.images];
imgs.forEach(i => { i.loading = "eager"; });
Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })))
  .then(() => done(imgs.map(i => ({src: i.src, width: i.naturalWidth}))));
"""


@pytest.mark.parametrize("page", PAGES_WITH_MATH)
def test_math_is_typeset_offline(browser, page):
    result = browser.read(page, TYPESET)
    assert result["math"] > 0, f"{page} has no math to check"
    assert result["typeset"] == result["math"], f"{page}: untypeset math: {result}"
    assert result["errors"] == 0, f"{page}: {result['errors']} TeX errors"


@pytest.mark.parametrize("page,at_least", [("book/intro.html", 1)] + [(c, 1) for c in CHAPTERS])
def test_figures_load_offline(browser, page, at_least):
    images = browser.read(page, IMAGES)
    figures = [i for i in images if "_images/" in i["src"]]
    assert len(figures) >= at_least, f"{page}: expected {at_least}+ figures, found {images}"
    broken = [i["src"] for i in images if i["width"] == 0]
    assert not broken, f"{page}: images that did not load: {broken}"


def test_every_resource_is_local(browser):
    for page in PAGES_WITH_MATH:
        browser.read(page, TYPESET)
        urls = browser.driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        remote = [u for u in urls if not u.startswith("file:")]
        assert not remote, f"{page} asked the network for {remote}"


# ---------------------------------------------------------------------------------------------
# What a reader sees at 1280 px.

# ``typeset``: a promise that MathJax has typeset the page (MathJax may start after the load
# event: it is given 20 s to start and 20 s more to typeset), or at once on a page without math.
# It never rejects: a page MathJax failed on is still read, and shows its raw TeX.
MATHJAX_READY = """
const typeset = new Promise(resolve => {  // MathJax may start after the load event
  const hasMath = [...document.scripts].some(s => /mathjax|tex-/i.test(s.src));
  const started = Date.now();
  (function ready() {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) {  // at most 20 s more
      const timeout = new Promise(r => setTimeout(r, 20000));
      resolve(Promise.race([MathJax.startup.promise.catch(() => null), timeout]));
      return;
    }
    if (!hasMath || Date.now() - started > 20000) { resolve(); return; }
    setTimeout(ready, 100);
  })();
});
"""

# The article's text with code, printed output and typeset math left out: what is left should be
# prose, so TeX or Markdown syntax found in it was not rendered. Collapsed boxes are opened first.
PROSE = """
const done = arguments[arguments.length - 1];
document.querySelectorAll("details").forEach(d => { d.open = true; });
""" + MATHJAX_READY + """
typeset.then(() => {
  const article = document.querySelector("article.bd-article");
  const prose = article.cloneNode(true);
  prose.querySelectorAll("pre, code, script, style, .math, mjx-container").forEach(e => e.remove());
  done({prose: prose.textContent, all: article.textContent});
}).catch(e => done({error: String(e)}));
"""
RAW_MARKUP = {
    "TeX": re.compile(r"\$|\\[()\[\]]|\\[A-Za-z]{2,}"),  # $…$, \(…\), \[…\], \beta
    # | --- | (smart punctuation turns an unrendered |---| into |—|)
    "a Markdown table": re.compile(r"\|\s*:?(?:-{3,}|[—–]-*)\s*:?\s*\|"),
}


def snippets(pattern: re.Pattern, text: str, width: int = 40, most: int = 3) -> list[str]:
    """Up to ``most`` pieces of ``text`` around matches of ``pattern`` (not overlapping)."""
    found, end = [], 0
    for m in pattern.finditer(text):
        if m.start() >= end:
            end = m.end() + width
            found.append(" ".join(text[max(0, m.start() - width) : end].split()))
    return found[:most]


@pytest.mark.parametrize("page", pages("raw markup", PAGES))
def test_no_raw_markup_in_the_text(browser, page):
    prose = browser.read(page, PROSE)["prose"]
    found = {what: snippets(pattern, prose) for what, pattern in RAW_MARKUP.items()}
    found = {what: hits for what, hits in found.items() if hits}
    assert not found, f"{page} shows unrendered {found}"


@pytest.mark.parametrize("page", pages("undecodable bytes", PAGES))
def test_no_undecodable_bytes_shown(browser, page):
    """U+FFFD is what invalid UTF-8 decodes to: a reader sees a black diamond, not the bytes."""
    text = browser.read(page, PROSE)["all"]
    bad = snippets(re.compile("\ufffd+"), text, width=25)
    assert not bad, f"{page} shows replacement characters instead of bytes: {bad}"


# Words about how the book was made rather than about its subject: the book cites its sources
# and describes the machine a number was measured on, not the circumstances of writing it.
INTERNAL = re.compile(
    r"reference sheet|\bthe issue\b|\bsession\b|shared (?:\d-core )?machine"
    r"|machines? (?:are |is )?shared|other jobs",
    re.IGNORECASE,
)


@pytest.mark.parametrize("page", pages("internal words", PAGES))
def test_no_internal_words(browser, page):
    """Prose, shown code and printed output alike."""
    text = browser.read(page, PROSE)["all"]
    found = snippets(INTERNAL, text, width=30)
    assert not found, f"{page} talks about its own making: {found}"


CAPTIONS = """
return [...document.querySelectorAll("article.bd-article code")].map(c => c.textContent.trim())
"""
SOURCE_CAPTION = re.compile(r"^\S+\.py, lines \d+-\d+$")  # what show_source writes


@pytest.mark.parametrize("page", pages("source captions", CHAPTERS))
def test_source_captions_name_library_files(browser, page):
    """Every chapter shows the library's source; each caption names a file of ``gpt2kimi/``."""
    captions = [c for c in browser.read(page, CAPTIONS, wait=False) if SOURCE_CAPTION.match(c)]
    assert captions, f"{page} shows no library source"
    outside = [c for c in captions if not c.startswith("gpt2kimi/")]
    assert not outside, f"{page} shows source from outside the library: {outside}"


# The house style draws text at 9-11 pt: 10 pt is 13.9 px at 100 dpi. Shown at 0.86 of that
# scale it is 12 px, the size of the book's code; any smaller and axis labels become hard to read.
MIN_FIGURE_SCALE = 0.86
FIGURES = """
const done = arguments[arguments.length - 1];
const imgs = [...document.querySelectorAll("article.bd-article img")];
Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })))
  .then(() => done(imgs.map(i => ({
    src: i.src, natural: i.naturalWidth, shown: i.getBoundingClientRect().width,
  }))));
"""


def image_dpi(src: str) -> float:
    """The dots per inch a PNG records (matplotlib writes its savefig dpi); 100 if it has none."""
    from PIL import Image

    with Image.open(unquote(urlparse(src).path)) as image:
        return float(image.info.get("dpi", (100, 100))[0])


@pytest.mark.parametrize("page", pages("figure scale", ["book/intro.html", *CHAPTERS]))
def test_figures_are_shown_at_a_legible_scale(browser, page):
    """A figure's text appears at ≥ MIN_FIGURE_SCALE of its size in a 100-dpi rendering."""
    figures = [f for f in browser.read(page, FIGURES) if f["src"].endswith(".png")]
    assert figures, f"{page} has no figures"
    shrunk = []
    for f in figures:
        scale = f["shown"] / f["natural"] * image_dpi(f["src"]) / 100
        if scale < MIN_FIGURE_SCALE:
            name = Path(urlparse(f["src"]).path).name
            shrunk.append(f"{name[:12]}: {f['natural']} px shown at {f['shown']:.0f} ({scale:.2f})")
    assert not shrunk, f"{page}: figures shrunk below {MIN_FIGURE_SCALE} of their size: {shrunk}"


# Code blocks, printed output, display math and tables that are wider than the article's text
# column (they scroll sideways, or stick out of the column).
OVERFLOW = """
const done = arguments[arguments.length - 1];
document.querySelectorAll("details").forEach(d => { d.open = true; });
""" + MATHJAX_READY + """
typeset.then(() => {
  const article = document.querySelector("article.bd-article");
  const style = getComputedStyle(article);
  const right = article.getBoundingClientRect().right - parseFloat(style.paddingRight);
  const kinds = {
    "code or output": "pre",
    "display math": "div.math, mjx-container[display='true']",
    "table": "table",
  };
  const wide = [];
  for (const [kind, selector] of Object.entries(kinds)) {
    for (const el of article.querySelectorAll(selector)) {
      const box = el.getBoundingClientRect();
      if (box.width === 0) continue;  // not displayed
      const scrolls = el.scrollWidth > el.clientWidth + 1;
      const sticksOut = box.right > right + 1;
      if (scrolls || sticksOut) {
        const longest = Math.max(...el.textContent.split("\\n").map(l => l.length));
        wide.push({kind, width: Math.max(el.scrollWidth, box.width), column: el.clientWidth,
                   chars: longest, text: el.textContent.trim().slice(0, 50)});
      }
    }
  }
  done({column: right - article.getBoundingClientRect().left - parseFloat(style.paddingLeft),
        wide});
}).catch(e => done({error: String(e)}));
"""


@pytest.mark.parametrize("page", pages("overflow", PAGES))
def test_code_math_and_tables_fit_the_column(browser, page):
    result = browser.read(page, OVERFLOW)
    wide = [
        f"{w['kind']} {w['width']:.0f} px > {w['column']} px"
        + (f" ({w['chars']} characters)" if w["kind"] == "code or output" else "")
        + f": {w['text']!r}"
        for w in result["wide"]
    ]
    assert not wide, f"{page} (column {result['column']:.0f} px) scrolls sideways: {wide}"
