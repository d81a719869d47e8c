"""Screenshots of the built documentation site (`make docs`) in headless Chromium, and a check
that it reads offline: the navigation and the search box render, and a search finds pages.

    python scripts/docs_screenshots.py [--site site] [--out docs/images]

Serves the built site on 127.0.0.1 (a free port) and opens three pages with every host but
the loopback unresolvable (no network is used or needed): the home page, a guide and the
config-key reference, each saved as a PNG; then the home page with `?q=accumulation` (the
theme's own search, its index in the site), whose rendered DOM must list results, also
opened from `file://` (the offline plugin's inlined index). Needs Debian's `chromium`
(`apt-get install -y chromium`). Exit 0 when every check passes, 1 when one fails.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = {  # screenshot name -> page of the site
    "site-home.png": "index.html",
    "site-guide.png": "guides/parallelism.html",
    "site-config-keys.png": "reference/config.html",
}
SEARCH_QUERY = "accumulation"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
    # Offline, demonstrably: any host but the loopback does not resolve.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        sys.exit("docs_screenshots: no chromium on PATH: apt-get install -y chromium")
    return found


@contextlib.contextmanager
def serve(site: Path) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1, at a free port, while the block runs."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
    JSON messages ending in NUL on fds 3 and 4), so a check can wait for what a reader waits
    for (the search's index, built by a web worker in real time) before it looks."""

    def __init__(self, profile: Path) -> None:
        pipe_r, self._to_child = os.pipe()
        self._from_child, pipe_w = os.pipe()
        # Above 4, so that the child's dup2 onto 3 and 4 cannot overwrite one with the other.
        to_child_r = fcntl.fcntl(pipe_r, fcntl.F_DUPFD, 10)
        from_child_w = fcntl.fcntl(pipe_w, fcntl.F_DUPFD, 10)
        os.close(pipe_r)
        os.close(pipe_w)

        def onto_3_and_4() -> None:
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        cmd = [chromium(), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe"]
        self.proc = subprocess.Popen(
            cmd,
            preexec_fn=onto_3_and_4,
            pass_fds=(3, 4),  # kept open past the preexec (the rest are closed after it)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer, self._id = b"", 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]

    def call(self, method: str, session: bool = False, **params: object) -> dict:
        """Send one command and return its result (events in between are dropped)."""
        self._id += 1
        message: dict = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str, width: int = 1280, height: int = 860) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.call("Page.navigate", session=True, url=url)

    def wait_for(self, expression: str, timeout_s: float = 30) -> object:
        """The first truthy value of a JavaScript expression, polled; None after the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = self.call(
                "Runtime.evaluate", session=True, expression=expression, returnByValue=True
            )["result"]
            if result.get("value"):
                return result["value"]
            time.sleep(0.25)
        return None

    def screenshot(self, out: Path) -> None:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        out.write_bytes(base64.b64decode(data))
        shrink(out)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):
            self.call("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to_child)
        os.close(self._from_child)


def shrink(png: Path) -> None:
    """A page's screenshot in 64 colours (a third of the bytes, no visible loss on the theme's
    flat colours), where Pillow is installed; else kept as taken."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(png) as image:
        small = image.convert("RGB").quantize(
            64, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
        )
    small.save(png, optimize=True)


# What a reader must see on every page, and what a search lists.
HAS_NAV_AND_SEARCH = (
    "!!document.querySelector('.md-nav') && !!document.querySelector('.md-search__input')"
)
SEARCH_RESULTS = "document.querySelectorAll('.md-search-result__item').length"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=REPO / "site", help="the built site")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        sys.exit(f"docs_screenshots: {args.site} has no index.html: run `make docs` first")
    args.out.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, serve(args.site) as base:
        browser = Browser(Path(tmp))
        try:
            for name, page in PAGES.items():
                browser.open(f"{base}/{page}")
                if not browser.wait_for(HAS_NAV_AND_SEARCH):
                    problems.append(f"{page}: no navigation or no search box rendered")
                browser.wait_for("document.fonts.status === 'loaded'", 5)
                browser.screenshot(args.out / name)
                print(f"wrote {args.out / name}")
            for where, url in (
                ("http", f"{base}/index.html?q={SEARCH_QUERY}"),
                ("file://", (args.site / "index.html").resolve().as_uri() + f"?q={SEARCH_QUERY}"),
            ):
                browser.open(url)
                found = browser.wait_for(SEARCH_RESULTS, 60)
                if not found:
                    problems.append(f"{where}: the search for {SEARCH_QUERY!r} listed no result")
                else:
                    print(f"search over {where}: {found} results for {SEARCH_QUERY!r}")
                if where == "http":
                    browser.screenshot(args.out / "site-search.png")
                    print(f"wrote {args.out / 'site-search.png'}")
        finally:
            browser.close()
    for problem in problems:
        print(f"FAIL {problem}")
    if not problems:
        print(
            "ok: navigation and search box on every page; search finds pages over http and file://"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
