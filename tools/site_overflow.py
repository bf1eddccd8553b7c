"""Does a page of the built site fit a phone? Headless Chromium measures it, and takes screenshots on request.

For each page (a path under the built site, e.g. ``privacy/index.html``) Chromium opens the page in a viewport of
``--width`` CSS pixels (default 390, a phone; emulated through the DevTools protocol, since a headless window is at
least 500 px wide) and reports ``document.documentElement.scrollWidth`` against ``clientWidth``: the page overflows
sideways when the first is larger. Wide tables and code blocks must scroll inside their own box, never widen the page.
For a page that overflows, the elements that stick out furthest (outside any box of their own that scrolls or clips)
are named, to say what to fix; so is what a box of the text cuts off (hides instead of scrolling). ``--verbose``
also lists the boxes that scroll inside the page (allowed: a wide table, a long code line).

The site's math (MathJax) and diagrams (Mermaid) load from a CDN; without a network they stay as their text source.
``--unpkg DIR`` serves them from a local copy instead (``DIR/mathjax@3/es5/tex-mml-chtml.js`` and
``DIR/mermaid@11/dist/mermaid.min.js``: the npm packages, unpacked), so that the measurement and the screenshots show
the rendered math and diagrams.

Only the standard library and a Chromium binary (``$CHROMIUM``, else ``chromium``, ``chromium-browser`` or
``google-chrome`` on PATH), driven over ``--remote-debugging-pipe``. Exit status 1 when a page overflows, 2 when no
Chromium is found.

    mkdocs build --strict --site-dir /tmp/site
    python tools/site_overflow.py /tmp/site                      # the PAGES, at 390 px
    python tools/site_overflow.py /tmp/site --pages index.html --shots /tmp/shots --shot-widths 1280 390
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: The pages checked by default: the privacy overview, the configuration reference and the quickstart.
PAGES = ("privacy/index.html", "reference/configuration/index.html", "getting-started/quickstart/index.html")
PHONE = (390, 844)
CDN = "https://unpkg.com/"
NO_CHROMIUM = "no Chromium binary found (chromium, chromium-browser, google-chrome on PATH, or $CHROMIUM)"

# Waits (at most `wait` ms) for the math and the diagrams the page could render, then measures.
MEASURE = """
(async (wait, width) => {
  const until = Date.now() + wait, sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  while (document.querySelector("pre.mermaid") && Date.now() < until) await sleep(100);
  await sleep(200);
  const box = (el) => {
    let name = el.tagName.toLowerCase();
    if (el.id) name += "#" + el.id;
    const classes = typeof el.className === "string" ? el.className.trim() : "";
    if (classes) name += "." + classes.split(/\\s+/).join(".");
    return name;
  };
  // The box that keeps `el` from widening the page: an ancestor that scrolls or clips sideways, or a fixed one
  // (the theme's off-canvas menus).
  const container = (el) => {
    for (let p = el; p && p !== document.body; p = p.parentElement) {
      const style = getComputedStyle(p);
      if (p !== el && style.overflowX !== "visible") return p;
      if (style.position === "fixed") return p;
    }
    return null;
  };
  const wider = [], cut = [];
  for (const el of document.querySelectorAll("body *")) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || el.closest("mjx-assistive-mml")) continue;  // MathJax's copy for screen readers
    const item = {element: box(el), right: Math.round(r.right), text: (el.textContent || "").trim().slice(0, 60)};
    const inside = container(el);
    if (inside === null) {
      if (r.right > width + 0.5) wider.push(item);
    } else if (el.closest("article") && ["hidden", "clip"].includes(getComputedStyle(inside).overflowX)
               && r.right > inside.getBoundingClientRect().right + 0.5 && inside.closest("article")) {
      // cut off: sticks out of a box that hides it instead of scrolling
      cut.push({...item, element: `${item.element} in ${box(inside)}`});
    }
  }
  // Boxes of the text that scroll sideways to show all they hold (wide tables, long code lines): allowed, listed.
  const scrolls = [...document.querySelectorAll("article *")].filter((el) =>
    ["auto", "scroll"].includes(getComputedStyle(el).overflowX) && el.scrollWidth > el.clientWidth + 1
  ).map((el) => ({element: box(el), scrollWidth: el.scrollWidth, clientWidth: el.clientWidth,
                  text: (el.textContent || "").trim().slice(0, 40)}));
  const furthest = (items) => items.sort((a, b) => b.right - a.right).slice(0, 8);
  const root = document.documentElement;
  return {
    scrollWidth: root.scrollWidth, clientWidth: root.clientWidth, innerWidth: window.innerWidth,
    height: root.scrollHeight,
    math: document.querySelectorAll("mjx-container").length,
    diagrams: document.querySelectorAll("div.mermaid").length,
    offenders: furthest(wider), cut: furthest(cut), scrolls,
  };
})
"""


@dataclass(frozen=True)
class Overflow:
    """What Chromium measured on one page in a viewport ``width`` CSS pixels wide.

    ``scroll_width``: the page's width (``document.documentElement.scrollWidth``); on a phone a page wider than the
    screen is shown zoomed out, so ``inner_width`` (``window.innerWidth``) then grows past ``width`` too.
    ``offenders``: what sticks out of the page, furthest first; ``cut``: what a box of the text hides instead of
    scrolling (cut off, out of reach). ``scrolls``: the boxes of the text (a wide table, a long code line) that
    scroll sideways inside the page, as they may.
    """

    page: str
    width: int
    scroll_width: int
    client_width: int
    inner_width: int
    math: int
    diagrams: int
    offenders: list[dict]
    cut: list[dict]
    scrolls: list[dict]

    @property
    def overflows(self) -> bool:
        return max(self.scroll_width, self.inner_width) > self.width or bool(self.cut)

    def line(self, verbose: bool = False) -> str:
        verdict = "OVERFLOWS" if self.overflows else "fits"
        head = (
            f"{self.page} at {self.width} px: scrollWidth {self.scroll_width}, clientWidth {self.client_width}, "
            f"innerWidth {self.inner_width}: {verdict}; {len(self.scrolls)} boxes scroll inside "
            f"({self.math} formulas and {self.diagrams} diagrams rendered)"
        )
        rows = [f"    {o['right']} px  {o['element']}  {o['text']!r}" for o in self.offenders]
        rows += [
            f"    scrolls inside its box: {s['scrollWidth']} px in {s['clientWidth']}: {s['element']}  {s['text']!r}"
            for s in self.scrolls
            if verbose
        ]
        rows += [f"    cut off at {o['right']} px  {o['element']}  {o['text']!r}" for o in self.cut]
        return "\n".join([head, *rows])


def find_chromium() -> str | None:
    """The Chromium binary: ``$CHROMIUM``, else the first of chromium, chromium-browser, google-chrome on PATH."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    return None


class Browser:
    """Headless Chromium driven over ``--remote-debugging-pipe`` (JSON messages ending in NUL on fds 3 and 4)."""

    def __init__(self, binary: str, profile: Path, timeout: float = 60.0) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def pipes() -> None:  # in the child: its fd 3 reads our messages, its fd 4 writes its answers
            read, write = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 100), fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 100)
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.process = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--hide-scrollbars",
                "--allow-file-access-from-files",
                "--remote-debugging-pipe",
                "--host-resolver-rules=MAP * ~NOTFOUND",  # offline at once: no page waits for a CDN or a font
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(3, 4),
            preexec_fn=pipes,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.timeout, self._id, self._buffer, self.events = timeout, 0, b"", []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer within {self.timeout:.0f} s")
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited (status {self.process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: bool = False, **params) -> dict:
        """Sends one DevTools command (to the page when ``session``) and returns its result."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            answer = self._message(deadline)
            if answer.get("id") == self._id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]
            self.events.append(answer)

    def wait_for(self, event: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not any(e.get("method") == event for e in self.events):
            self.events.append(self._message(deadline))
        self.events.clear()

    def viewport(self, width: int, height: int) -> None:
        """A viewport of ``width`` x ``height`` CSS pixels (a phone's, touch and all, below 600 px)."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=width < 600,
        )

    def open(self, url: str, width: int, height: int) -> None:
        """``url`` in a viewport of ``width`` x ``height`` CSS pixels."""
        self.viewport(width, height)
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.call(
            "Runtime.evaluate", session=True, expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"the page's script failed: {result['exceptionDetails']}")
        return result["result"]["value"]

    def screenshot(self, path: Path, width: int, height: int) -> None:
        """A PNG of the page's top ``height`` pixels: the viewport made that tall first, then the theme's
        transitions given a second (a capture beyond the viewport caught the navigation tabs mid-fade)."""
        self.viewport(width, height)
        time.sleep(1.0)
        clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
        data = self.call("Page.captureScreenshot", session=True, format="png", clip=clip)
        Path(path).write_bytes(base64.b64decode(data["data"]))

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


def _copy_site(site: Path, dest: Path, unpkg: Path | None) -> Path:
    """The built site as it is, or with ``unpkg`` a copy whose CDN links point at that local folder."""
    if unpkg is None:
        return Path(site)
    copy = dest / "site"
    shutil.copytree(site, copy)
    local = Path(unpkg).resolve().as_uri() + "/"
    for path in [*copy.rglob("*.html"), *copy.rglob("*.js")]:
        text = path.read_text(encoding="utf-8")
        if CDN in text:
            path.write_text(text.replace(CDN, local), encoding="utf-8")
    return copy


def check(
    site: Path,
    pages: tuple[str, ...] = PAGES,
    width: int = PHONE[0],
    *,
    unpkg: Path | None = None,
    shots: Path | None = None,
    shot_widths: tuple[int, ...] = (),
    shot_height: int = 3000,
    chromium: str | None = None,
) -> list[Overflow]:
    """``scrollWidth`` against ``clientWidth`` of each page of the built ``site`` at ``width`` CSS pixels.

    With ``shots``, also a PNG of each page at each of ``shot_widths`` (its top ``shot_height`` pixels), named
    ``<page>-<width>.png`` (``home`` for the home page).
    """
    binary = chromium or find_chromium()
    if binary is None:
        raise FileNotFoundError(NO_CHROMIUM)
    wait_ms = 15000 if unpkg is not None else 0  # offline, Mermaid never comes
    results = []
    with tempfile.TemporaryDirectory(prefix="dp-overflow-") as tmp:
        root = _copy_site(Path(site), Path(tmp), unpkg)
        browser = Browser(binary, Path(tmp) / "profile")
        try:
            for page in pages:
                path = root / page
                if not path.is_file():
                    raise FileNotFoundError(f"{page}: no such page in {site}")
                browser.open(path.as_uri(), width, PHONE[1])
                data = browser.evaluate(f"{MEASURE}({wait_ms}, {width})")
                results.append(
                    Overflow(
                        page,
                        width,
                        data["scrollWidth"],
                        data["clientWidth"],
                        data["innerWidth"],
                        data["math"],
                        data["diagrams"],
                        data["offenders"],
                        data["cut"],
                        data["scrolls"],
                    )
                )
                if shots is None:
                    continue
                Path(shots).mkdir(parents=True, exist_ok=True)
                name = page.removesuffix("index.html").strip("/").replace("/", "-") or "home"
                for shot_width in shot_widths:
                    browser.open(path.as_uri(), shot_width, 900)
                    shown = browser.evaluate(f"{MEASURE}({wait_ms}, {shot_width})")
                    browser.screenshot(
                        Path(shots) / f"{name}-{shot_width}.png", shot_width, min(shown["height"], shot_height)
                    )
        finally:
            browser.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the built site (mkdocs build --site-dir)")
    parser.add_argument("--pages", nargs="+", default=list(PAGES), help="pages under the site (default: %(default)s)")
    parser.add_argument("--width", type=int, default=PHONE[0], help="CSS pixels (default: %(default)s)")
    parser.add_argument("--unpkg", type=Path, help="a local copy of the CDN's mathjax@3 and mermaid@11 folders")
    parser.add_argument("--verbose", action="store_true", help="also list the boxes that scroll inside the page")
    parser.add_argument("--shots", type=Path, help="also save a screenshot of each page in this folder")
    parser.add_argument("--shot-widths", type=int, nargs="+", default=[1280, PHONE[0]], help="(default: %(default)s)")
    parser.add_argument("--shot-height", type=int, default=3000, help="at most this many pixels (default: %(default)s)")
    args = parser.parse_args(argv)
    if find_chromium() is None:
        print(NO_CHROMIUM, file=sys.stderr)
        return 2
    results = check(
        args.site,
        tuple(args.pages),
        args.width,
        unpkg=args.unpkg,
        shots=args.shots,
        shot_widths=tuple(args.shot_widths),
        shot_height=args.shot_height,
    )
    for result in results:
        print(result.line(args.verbose))
    return 1 if any(r.overflows for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
