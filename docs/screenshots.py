"""Screenshots of the documentation site, to look at it as a reader does.

Builds the site (``mkdocs build --strict``, as ``make docs``) into a temporary
folder or ``--site``, serves it on 127.0.0.1 on a free port and takes a PNG of
each page below with headless Chromium (Debian's ``chromium`` package, or
``--chromium PATH``). Not a test: a developer runs it and looks at the
pictures (``make docs-screenshots``)::

    .venv/bin/python docs/screenshots.py                   # into /tmp/fitlib-screens
    .venv/bin/python docs/screenshots.py --out shots --height 4000
    .venv/bin/python docs/screenshots.py --no-build --site site  # an existing build

It prints the path of each PNG; a page that fails to load or a screenshot
that Chromium does not write ends it with an error.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The pages, by the name of their screenshot: the home page, a how-to, a
# reference page of a callback, a tutorial (tables and plots), the generated
# tables and the largest reference page.
PAGES = {
    "home": "",
    "how-to-resume-a-crashed-run": "how-to/resume-a-crashed-run/",
    "reference-early-stopping": "reference/callbacks/early_stopping/",
    "tutorial-01-quickstart": "tutorials/01_quickstart/",
    "reference-state": "reference/state/",
    "reference-learner": "reference/learner/",
}

# Headless, offline and with a profile of its own: no first-run pages, no
# background requests, no GPU.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def build(site: Path) -> None:
    """``make docs``'s build, into ``site``."""
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}  # the theme's banner
    if subprocess.run(
        [*command, "--site-dir", str(site)], cwd=ROOT, env=env
    ).returncode:
        raise SystemExit("mkdocs build --strict failed (its messages are above)")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # Chromium hung up
            super().handle_error(request, client_address)


def serve(site: Path) -> tuple[Server, str]:
    """Serves ``site`` on 127.0.0.1 on a free port, in a thread; the server and
    its address."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def screenshot(chromium: str, url: str, png: Path, width: int, height: int) -> None:
    """One PNG of ``url``, ``width`` x ``height`` pixels, by headless Chromium."""
    try:
        urllib.request.urlopen(url, timeout=10).close()
    except urllib.error.URLError as error:  # a page the site lacks: 404
        raise SystemExit(f"{url}: {error}") from None
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="fitlib-chromium-") as profile:
        done = subprocess.run(
            [
                chromium,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                # Time for the theme's scripts (tabs, search) to run first.
                "--virtual-time-budget=3000",
                f"--screenshot={png}",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    if not png.is_file():
        raise SystemExit(
            f"chromium wrote no screenshot of {url} (exit {done.returncode}):\n"
            f"{done.stderr[-2000:]}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("/tmp/fitlib-screens"),
        help="folder for the PNGs (default: /tmp/fitlib-screens)",
    )
    parser.add_argument(
        "--site",
        type=Path,
        help="build the site into this folder (default: a temporary one)",
    )
    parser.add_argument(
        "--no-build",
        action="store_true",
        help="serve --site as it is, without building it",
    )
    parser.add_argument(
        "--chromium",
        default=shutil.which("chromium") or "chromium",
        help="the Chromium executable (default: chromium on PATH)",
    )
    parser.add_argument("--width", type=int, default=1280, help="default: 1280")
    parser.add_argument("--height", type=int, default=2000, help="default: 2000")
    parser.add_argument(
        "pages",
        nargs="*",
        metavar="PAGE",
        help="site paths to shoot instead of the default pages, e.g. "
        "reference/metrics/",
    )
    args = parser.parse_args(argv)
    if args.no_build and args.site is None:
        parser.error("--no-build needs --site, the folder of a built site")
    if shutil.which(args.chromium) is None:
        parser.error(
            f"--chromium {args.chromium!r} is not an executable; install Debian's "
            "chromium package or pass its path"
        )
    pages = (
        {page.strip("/").replace("/", "-") or "home": page for page in args.pages}
        if args.pages
        else PAGES
    )

    with tempfile.TemporaryDirectory(prefix="fitlib-site-") as scratch:
        site = args.site or Path(scratch)
        if not args.no_build:
            build(site)
        args.out.mkdir(parents=True, exist_ok=True)
        server, address = serve(site)
        try:
            for name, page in pages.items():
                png = args.out / f"{name}.png"
                screenshot(args.chromium, address + page, png, args.width, args.height)
                print(png)
        finally:
            server.shutdown()


if __name__ == "__main__":
    main()
