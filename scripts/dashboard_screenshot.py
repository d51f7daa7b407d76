"""Screenshot a Ray dashboard page with headless Chromium (Debian's ``chromium``).

    python scripts/dashboard_screenshot.py http://127.0.0.1:8265 out.png \\
        --page '#/actors' --wait-for RayTrainWorker

Why not ``chromium --screenshot URL``: Ray 2.60 keeps token authentication on, and the
dashboard's web app reads the token from a cookie that a plain command line cannot set.
So this drives Chromium over the DevTools protocol (a WebSocket, through aiohttp, which
``ray[default]`` already installs): set the token cookie, open the page, wait until the
given text shows up (the web app renders after its API calls return), then capture.
Chromium runs with a fresh profile and without network side traffic, and is killed (its
own process only) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--mute-audio",
)


class ScreenshotError(RuntimeError):
    """The screenshot could not be taken; the message says why."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token() -> str | None:
    """The cluster token this machine holds (None when token auth is off)."""
    try:
        from ray_mesh import private_apis

        private_apis.enable_token_auth()  # quietly: the user asked for a picture
        header = private_apis.auth_headers().get("authorization", "")
    except Exception:  # noqa: BLE001 - Ray without token auth
        return None
    return header.split(" ", 1)[1] if header.lower().startswith("bearer ") else None


def _page_ws_url(port: int, deadline: float) -> str:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        except OSError:
            pass
        time.sleep(0.3)
    raise ScreenshotError("Chromium's DevTools endpoint did not come up.")


async def _drive(ws_url: str, url: str, out: str, wait_for: str | None, width: int,
                 height: int, token: str | None, deadline: float) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.ws_connect(
            ws_url, max_msg_size=0) as ws:
        next_id = 0

        async def call(method: str, **params):
            nonlocal next_id
            next_id += 1
            await ws.send_json({"id": next_id, "method": method, "params": params})
            while True:
                msg = await asyncio.wait_for(ws.receive_json(),
                                             max(0.1, deadline - time.monotonic()))
                if msg.get("id") == next_id:
                    if "error" in msg:
                        raise ScreenshotError(f"{method}: {msg['error']}")
                    return msg.get("result", {})

        await call("Network.enable")
        if token:
            await call("Network.setCookie", name="ray-authentication-token", value=token,
                       url=url.split("#", 1)[0])
        await call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                   deviceScaleFactor=1, mobile=False)
        await call("Page.navigate", url=url)
        text = ""
        while time.monotonic() < deadline:
            res = await call("Runtime.evaluate",
                             expression="document.body ? document.body.innerText : ''")
            text = res.get("result", {}).get("value", "") or ""
            if (wait_for is None and len(text) > 200) or (wait_for and wait_for in text):
                break
            await asyncio.sleep(0.5)
        else:
            raise ScreenshotError(f"{url} did not show {wait_for!r} in time; the page read: "
                                  f"{text[:300]!r}")
        await asyncio.sleep(1.0)  # let charts and tables finish their last paint
        shot = await call("Page.captureScreenshot", format="png")
        with open(out, "wb") as f:
            f.write(base64.b64decode(shot["data"]))
        return text


def screenshot(dashboard: str, out: str, *, page: str = "#/overview",
               wait_for: str | None = None, width: int = 1600, height: int = 1000,
               timeout_s: float = 60.0, chromium: str | None = None) -> str:
    """Save a PNG of ``dashboard``/``page`` to ``out``; returns the page's text."""
    binary = chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    if not binary:
        raise ScreenshotError("chromium is not installed: `apt-get install -y chromium`.")
    deadline = time.monotonic() + timeout_s
    port = _free_port()
    profile = tempfile.mkdtemp(prefix="ray_mesh_chromium_")
    proc = subprocess.Popen(
        [binary, *CHROMIUM_FLAGS, f"--remote-debugging-port={port}",
         f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        ws_url = _page_ws_url(port, deadline)
        url = dashboard.rstrip("/") + "/" + page.lstrip("/")
        return asyncio.run(_drive(ws_url, url, out, wait_for, width, height, _token(),
                                  deadline))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(profile, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dashboard", help="dashboard URL, e.g. http://127.0.0.1:8265")
    p.add_argument("out", help="PNG file to write")
    p.add_argument("--page", default="#/overview", help="page after the URL (default "
                   "#/overview; #/jobs, #/actors, #/cluster ...)")
    p.add_argument("--wait-for", default=None, help="text the page must show first")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    try:
        screenshot(args.dashboard, args.out, page=args.page, wait_for=args.wait_for,
                   timeout_s=args.timeout)
    except ScreenshotError as exc:
        print(f"dashboard_screenshot: {exc}", file=sys.stderr)
        return 1
    print(os.path.abspath(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
